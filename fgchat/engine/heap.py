"""The Python heap of a process that serves one engine: what is alive once the engine is built
(torch, the model, the graphs' Python objects) is moved out of the cyclic collector's reach
(`gc.freeze`), so that a full collection later walks only the objects made after it.

Measured: a full collection of a built engine's process (~200,000 objects, torch and transformers
imported) takes ~100 ms on a 2-core CPU VM, the size of the one-off stalls seen in 3 of 96 rounds
of an H200 bench (a round's TPOT mean up 0.7-0.8 ms over 128 tokens, its ITL median unchanged);
after the freeze a full collection takes well under 1 ms there.

The TUI's process freezes its own heap the same way once its engine is ready (~90,000 objects of
Textual, Rich and the widgets; no torch there), and again whenever a round of replies has ended,
unfrozen first so that the collection finds cyclic garbage among earlier rounds' objects too
(~100-140 ms at 250,000-310,000 objects on a 2-core VM, between rounds, not while text streams).

Invariant: frozen objects are still freed by reference counting; only cyclic garbage among them
stays until the process ends. So this is for processes that live with one engine (the engine
process, the benchmark, the TUI), not for a library caller that builds engine after engine.
"""

from __future__ import annotations

import gc


def freeze_heap(collect: bool = False) -> int:
    """Freeze every object now tracked by the collector; collect first if asked (it costs a full
    collection, ~100 ms, so the engine process skips it on its way to ready). Returns how many
    objects are frozen."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
