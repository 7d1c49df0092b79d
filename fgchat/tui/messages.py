"""Textual messages carrying engine events from the polling thread to the UI thread."""

from __future__ import annotations

from textual.message import Message


class EngineEvents(Message):
    """Every event the engine sent since the last poll (one or more step batches), in order.

    `generation` tells events of a restarted engine from those of the engine it replaced.
    """

    def __init__(self, events: list, generation: int) -> None:
        super().__init__()
        self.events = events
        self.generation = generation
