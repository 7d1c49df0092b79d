"""Continuous batching over NUM_SLOTS cache slots: a FIFO queue and the running set."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fgchat.engine.kv_cache import NUM_SLOTS
from fgchat.engine.requests import Sequence


class Scheduler:
    def __init__(self, max_batch: int = NUM_SLOTS) -> None:
        self.max_batch = max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # lane order of the next decode step
        self.admitted: list[Sequence] = []  # given a slot, not yet started (their prefill runs)
        self.free_slots = list(range(max_batch))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self, choose: Callable[[Sequence, list[int]], int] | None = None) -> list[Sequence]:
        """Move waiting sequences into free slots (FIFO): the lowest free slot, or the one
        `choose(seq, free_slots)` returns; returns the newly admitted ones."""
        new = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = choose(seq, self.free_slots) if choose is not None else self.free_slots[0]
            self.free_slots.remove(seq.slot)
            new.append(seq)
        self.admitted += new
        return new

    def start(self, seq: Sequence) -> None:
        if seq in self.admitted:
            self.admitted.remove(seq)
        self.running.append(seq)

    def release(self, seq: Sequence) -> None:
        """A sequence leaves at once: its slot is free for the next admission."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.admitted:
            self.admitted.remove(seq)
        if seq.slot >= 0 and seq.slot not in self.free_slots:
            self.free_slots.append(seq.slot)
            self.free_slots.sort()
        seq.slot = -1

    def every(self) -> list[Sequence]:
        """Every sequence the engine holds: running, admitted (prefilling) and waiting."""
        return [*self.running, *self.admitted, *self.waiting]

    def find(self, request_id: int) -> Sequence | None:
        for s in list(self.running) + list(self.waiting):
            if s.request_id == request_id:
                return s
        return None

    def remove_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
            return True
        except ValueError:
            return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
