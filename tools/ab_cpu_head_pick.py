"""CPU: the greedy head pick (model.cpu_head_pick) against the exact head in one process, switched
every round, so the VM's process-to-process spread does not enter the comparison.

The embedded model (or --model), `batch` requests of 64 random prompt tokens; each round runs
`steps` decode steps with the pick, then as many without it (alternating which comes first is not
needed: both see the same growth of context); prints the median step of each round and the
median paired difference. Usage:
    python tools/ab_cpu_head_pick.py [--model M | --preset NAME] [--dtype bfloat16] [--batch 1] [--rounds 12] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None, help="random weights of a preset's shape instead")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    eng = Engine(EngineConfig(model=a.model, preset=a.preset, device="cpu", max_context=2048, dtype=a.dtype))
    dec = eng.decoder
    pick = dec._cpu_pick
    if pick is None:
        raise SystemExit("no CPU head pick here (no native bf16, or FGCHAT_HEAD_PICK=0)")
    g = torch.Generator().manual_seed(0)
    budget = 10 + 2 * a.rounds * a.steps + 8
    for _ in range(a.batch):
        prompt = torch.randint(3, eng.cfg.vocab_size, (64,), generator=g).tolist()
        eng.submit(prompt, SamplingParams(max_tokens=budget, ignore_eos=True))
    for _ in range(10):
        eng.step()
    res: dict[str, list[float]] = {"pick": [], "exact": []}
    for _ in range(a.rounds):
        for name in ("pick", "exact"):
            dec._cpu_pick = pick if name == "pick" else None
            ts = []
            for _ in range(a.steps):
                t = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t)
            res[name].append(statistics.median(ts) * 1e3)
    dec._cpu_pick = pick
    for name, v in res.items():
        print(f"{a.dtype} batch {a.batch} {name:5}: median {statistics.median(v):.2f} ms; rounds "
              + " ".join(f"{x:.1f}" for x in v))
    d = [p - e for p, e in zip(res["pick"], res["exact"])]
    print(f"paired pick - exact: median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)} of {len(d)} "
          f"rounds faster")


if __name__ == "__main__":
    main()
