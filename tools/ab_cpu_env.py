"""CPU: an environment switch (FGCHAT_...=0 against =1) on the decode step, one fresh process per
round, the two settings alternating round by round (which goes first alternates too), so drift of
the VM over the run falls on both sides.

Each process: the embedded model (or --model / --preset) on CPU, `batch` requests with prompts of
P, P-5, P-10, ... random tokens, prefilled, 3 warm-up steps, then `steps` timed decode steps; it
prints the median step. With --what prefill it times instead `steps` admissions of `batch` such
prompts (all admitted together: their prefill and first tokens) after one untimed admission.
The parent prints each side's median and the median paired difference. Usage:
    python tools/ab_cpu_env.py FGCHAT_CPU_CACHE_FP32 [--batch 8] [--prompt 1000] [--rounds 8] [--steps 6]
        [--what decode|prefill]
"""

from __future__ import annotations

import argparse
import statistics
import time

from alternate import alternating_runs


def one_run(a: argparse.Namespace) -> float:
    import torch

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import SamplingParams

    eng = Engine(EngineConfig(model=a.model, preset=a.preset, device="cpu", dtype=a.dtype,
                              max_context=max(2048, a.prompt + a.steps + 16)))
    g = torch.Generator().manual_seed(0)
    if a.what == "prefill":
        return prefill_ms(eng, a, g)
    for i in range(a.batch):
        prompt = torch.randint(3, eng.cfg.vocab_size, (max(8, a.prompt - 5 * i),), generator=g).tolist()
        eng.submit(prompt, SamplingParams(max_tokens=a.steps + 8, ignore_eos=True))
    while len(eng.scheduler.running) < a.batch:
        eng.step()
    for _ in range(3):
        eng.step()
    ts = []
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def prefill_ms(eng, a: argparse.Namespace, g) -> float:  # noqa: ANN001
    """Median ms of admitting `batch` prompts together until every first token is out."""
    from fgchat.protocol.events import SamplingParams, TokenEvent

    ts = []
    for run in range(a.steps + 1):  # the first admission is untimed
        for i in range(a.batch):
            prompt = torch_randint(g, eng.cfg.vocab_size, max(8, a.prompt - 5 * i))
            eng.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        t = time.perf_counter()
        firsts = 0
        while firsts < a.batch:
            firsts += sum(isinstance(e, TokenEvent) and e.is_first_token for e in eng.step())
        if run:
            ts.append(time.perf_counter() - t)
        eng.run_until_done()
    return statistics.median(ts) * 1e3


def torch_randint(g, vocab: int, n: int) -> list[int]:  # noqa: ANN001
    import torch

    return torch.randint(3, vocab, (n,), generator=g).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("var")
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--what", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(f"{one_run(a):.4f}")
        return
    res: dict[str, list[float]] = {"0": [], "1": []}
    for _, val, line in alternating_runs(__file__, a.var, a.rounds):
        res[val].append(float(line))
    for val, v in res.items():
        print(f"{a.var}={val} {a.what} batch {a.batch} prompt {a.prompt}: median {statistics.median(v):.2f} ms; rounds "
              + " ".join(f"{x:.1f}" for x in v))
    d = [one - zero for one, zero in zip(res["1"], res["0"])]
    print(f"paired =1 - =0: median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)} of {len(d)} rounds faster")


if __name__ == "__main__":
    main()
