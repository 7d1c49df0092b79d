"""engine.heap.freeze_heap: garbage collected first when asked, everything alive frozen."""

from __future__ import annotations

import gc
import weakref

from fgchat.engine.heap import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_collects_first_and_freezes_what_is_alive():
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        dead = weakref.ref(a)
        del a, b
        kept = _Node()
        frozen = freeze_heap(collect=True)
        assert dead() is None
        # frozen objects freed by reference counting since (the call's own temporaries) leave it
        assert 0 < gc.get_freeze_count() <= frozen
        assert not gc.is_finalized(kept)
        assert not any(o is kept for o in gc.get_objects())  # in no generation: out of the collector's reach
    finally:
        gc.unfreeze()
