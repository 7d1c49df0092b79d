"""Time to first token of prompts longer than the last prefill bucket, each at a length of its own
(what a long chat sends turn after turn), then the first length once more.

Such a prefill runs eagerly at its own length in every mode, so a kernel that prepares itself per
new shape shows in each new length's TTFT and not in the repeated one's. One process, the modes
one after another; run it once per tree to compare trees (PYTHONPATH picks the tree).
Usage:
    python tools/ttft_long_prompt.py [--model M] [--device cuda] [--modes eager,full]
        [--lengths 2100,2230,2410,2650,3000] [--context 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def ttft_ms(eng, ids: list[int]) -> float:
    from fgchat.protocol.events import SamplingParams, TokenEvent

    t0 = time.perf_counter()
    first = None
    eng.submit(ids, SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, TokenEvent) and first is None:
                first = time.perf_counter() - t0
    return first * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--modes", default="eager,full")
    ap.add_argument("--lengths", default="2100,2230,2410,2650,3000")
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args()

    from fgchat.engine.core import Engine, EngineConfig

    lengths = [int(x) for x in a.lengths.split(",")]
    modes = a.modes.split(",")
    eng = Engine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, mode=modes[0],
                              max_context=a.context))
    rng = random.Random(0)
    vocab = eng.cfg.vocab_size
    for mode in modes:
        eng.set_mode(mode)
        ttft_ms(eng, [rng.randrange(vocab) for _ in range(64)])  # the mode's own first request
        new = [ttft_ms(eng, [rng.randrange(vocab) for _ in range(t)]) for t in lengths]
        again = ttft_ms(eng, [rng.randrange(vocab) for _ in range(lengths[0])])
        print(f"{mode:<6} new lengths " + " / ".join(f"{t}: {ms:.1f}" for t, ms in zip(lengths, new))
              + f" ms | median {statistics.median(new):.1f} ms | {lengths[0]} again: {again:.1f} ms")


if __name__ == "__main__":
    main()
