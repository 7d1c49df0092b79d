"""CUDA graphs of the fused prefill, one per token bucket (model.prefill.PREFILL_BUCKETS), and
of the batch route (model.prefill.batch_bucket), one per (prompts, padded length).

A prompt of T tokens runs the graph of bucket_for(T): its ids (zero-padded), the slot and the
last row index are copied into fixed input buffers, and the graph replays the same kernels as
the eager fused prefill at that bucket, so both give the same bits. B prompts admitted together
run the graph of (B, tb) the same way (captured on first use: up to 7 x 4 shapes).

Invariants:
- graphs share the decode graphs' memory pool (modes.capture); a prefill replay only runs when no decode step is
  in flight (the engine drains first), and each graph's output stays referenced here;
- the captured region reads the slot and the last row from device memory, never host values, and
  writes cache rows [0, bucket) of that slot only (rows >= T hold padding that decode overwrites
  before it reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fgchat.engine.model.decoder import Decoder
from fgchat.engine.model.prefill import (BATCH_MAX_T, PREFILL_BUCKETS, bucket_for, head, pack_batch,
                                        prefill_batch_last, prefill_last)
from fgchat.engine.modes.capture import GraphCapture
from fgchat.protocol.events import CaptureReport, Mode


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    # [1, H] (one prompt) or [B, H] (batch route): the final-normed last rows, written by each
    # replay; the LM head runs after the replay (exact, or the int8 pick for a greedy prompt)
    rows: torch.Tensor


class PrefillGraphs:
    def __init__(self, decoder: Decoder, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 cap: GraphCapture) -> None:
        self.dec = decoder
        self.k, self.v = k_caches, v_caches
        self.cap = cap
        self.cache_len = k_caches[0].shape[1]
        self.buckets = [b for b in PREFILL_BUCKETS if b <= self.cache_len]
        dev = decoder.device
        top = self.buckets[-1] if self.buckets else 1
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.last = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, _Graph] = {}
        self.reports: list[CaptureReport] = []
        n = k_caches[0].shape[0]  # slots: at most this many prompts in one batch
        self.batch_ids = torch.zeros(n * min(top, BATCH_MAX_T), dtype=torch.int64, device=dev)
        self.batch_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.batch_last = torch.zeros(n, dtype=torch.int64, device=dev)
        self.batch_graphs: dict[tuple[int, int], _Graph] = {}

    def covers(self, t: int) -> bool:
        """A graph serves prompts of t tokens (longer ones run eagerly)."""
        return bool(self.buckets) and 0 < t <= self.buckets[-1]

    @torch.inference_mode()
    def capture(self, bucket: int) -> _Graph:
        """Capture the prefill of `bucket` tokens: a warm-up run on the side stream with the
        current input buffers, then the capture. The warm-up writes rows [0, bucket) of the slot
        in self.slot, which is the slot about to be prefilled (or slot 0 before any request)."""
        cap = self.cap
        ids = self.ids[:bucket]
        with cap.measured(Mode.FULL, bucket, self.reports, kind="prefill"):
            with torch.cuda.stream(cap.stream):
                prefill_last(self.dec, ids, self.slot, self.last, self.k, self.v)
            cap.stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=cap.pool, stream=cap.stream):
                rows = prefill_last(self.dec, ids, self.slot, self.last, self.k, self.v)
            entry = _Graph(g, rows)
            self.graphs[bucket] = entry
        return entry

    def capture_idle(self, bucket: int) -> _Graph:
        """Capture `bucket` while no request runs (start-up, idle): the inputs are reset to a
        prompt of `bucket` tokens in slot 0 first (any slot is free then; the warm-up writes its
        rows). Inputs left by an earlier, longer prompt would index past the bucket."""
        self.ids[:bucket].zero_()
        self.slot.zero_()
        self.last.fill_(bucket - 1)
        return self.capture(bucket)

    def capture_all(self) -> None:
        for b in self.buckets:
            if b not in self.graphs:
                self.capture_idle(b)

    def run(self, ids: torch.Tensor, slot: int, greedy: bool = False) -> torch.Tensor:
        """Prefill `ids` [T] (int64, on the device) into `slot`; returns the last logits [V]
        (greedy: they serve an argmax only, see prefill.head)."""
        t = ids.shape[0]
        bucket = bucket_for(t, self.cache_len)
        self.ids[:t].copy_(ids)
        self.ids[t:bucket].zero_()
        self.slot.fill_(slot)
        self.last.fill_(t - 1)
        entry = self.graphs.get(bucket) or self.capture(bucket)  # inputs first: see capture
        entry.graph.replay()
        return head(self.dec, entry.rows, greedy)[0]

    def run_batch(self, prompts: list[tuple[torch.Tensor, int]], tb: int) -> list[torch.Tensor]:
        """The batch route (model.prefill.batch_bucket gave tb) for [(ids [T_j], slot_j)]; returns
        each prompt's last logits [V]. The graph of (B, tb) is captured on first use, after the
        inputs are written: its warm-up run prefills these very prompts."""
        b = len(prompts)
        pack_batch(prompts, tb, self.batch_ids, self.batch_slots, self.batch_last)
        entry = self.batch_graphs.get((b, tb)) or self._capture_batch(b, tb)
        entry.graph.replay()
        return list(head(self.dec, entry.rows).unbind(0))

    @torch.inference_mode()
    def _capture_batch(self, b: int, tb: int) -> _Graph:
        cap = self.cap
        args = (self.dec, self.batch_ids[:b * tb], self.batch_slots[:b], self.batch_last[:b], self.k, self.v)
        with cap.measured(Mode.FULL, b * tb, self.reports, kind="prefill"):
            with torch.cuda.stream(cap.stream):
                prefill_batch_last(*args)
            cap.stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=cap.pool, stream=cap.stream):
                rows = prefill_batch_last(*args)
            entry = _Graph(g, rows)
            self.batch_graphs[(b, tb)] = entry
        return entry
