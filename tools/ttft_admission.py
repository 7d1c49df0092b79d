"""TTFT of one admission round of K prompts: identical prompts (K replies, one shared prefill),
distinct prompts in one pass (batched prefill; its attention one SDPA over the right-padded
prompts, and, CUDA only, prompt by prompt as a variant), CUDA only: distinct prompts on the batch
route (FGCHAT_PREFILL_BATCH_ROUTE: one padded batch, a graph per shape in full mode; where the
lengths allow it) and one by one (FGCHAT_BATCHED_PREFILL=0; the CPU path always batches). Alternates the variants
round by round in one process and prints the median over rounds of each round's mean TTFT.

Usage: python tools/ttft_admission.py [--preset NAME (random weights) | --model PATH]
       [--k 8] [--prompt-len 512] [--rounds 5] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.model import prefill as pf
from fgchat.protocol.events import RequestFinished, SamplingParams
from fgchat.protocol.tuning import Tuning


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def round_ttft(eng: Engine, prompts: list[list[int]]) -> float:
    for p in prompts:
        eng.submit(p, SamplingParams(max_tokens=2, ignore_eos=True))
    done = [e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)]
    return statistics.mean(d.ttft_ms for d in done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--preset")
    ap.add_argument("--device")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    eng = Engine(EngineConfig(model=a.model, preset=a.preset, device=a.device, max_context=a.prompt_len + 64,
                              tuning=dataclasses.replace(Tuning.from_env(), prefix_reuse=False)))  # fresh prefills
    vocab, n, k = eng.cfg.vocab_size, a.prompt_len, a.k
    batched = eng.tuning
    variants = {"identical (shared prefill)": lambda r: [prompt(r, n, vocab)] * k,
                "distinct, one pass": lambda r: [prompt(1000 * r + i, n, vocab) for i in range(k)]}
    if eng.decoder.fused:
        variants["distinct, one pass, attention per prompt"] = variants["distinct, one pass"]
        variants["distinct, batch route"] = variants["distinct, one pass"]
        variants["distinct, one by one"] = variants["distinct, one pass"]
    padding = pf.PAD_SHORT_TMAX, pf.PAD_WASTE_LIMIT
    res: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(a.rounds + 1):  # round 0 warms up
        for name, make in variants.items():
            eng.tuning = dataclasses.replace(batched, batched_prefill="one by one" not in name)
            pf.PAD_SHORT_TMAX, pf.PAD_WASTE_LIMIT = (0, 0.0) if "per prompt" in name else padding
            eng.modes.batch_route = eng.decoder.fused and "batch route" in name
            t = round_ttft(eng, make(r))
            if r:
                res[name].append(t)
    eng.tuning = batched
    eng.modes.batch_route = eng.decoder.fused and batched.prefill_batch_route
    pf.PAD_SHORT_TMAX, pf.PAD_WASTE_LIMIT = padding
    info = eng.info()
    print(f"{info.model_name} on {info.device}, {info.dtype}: {k} prompts of {n} tokens, "
          f"median over {a.rounds} rounds of the round's mean TTFT")
    for name, xs in res.items():
        print(f"  {name:40s} {statistics.median(xs):9.2f} ms   {['%.2f' % x for x in xs]}")


if __name__ == "__main__":
    main()
