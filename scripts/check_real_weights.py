"""The README's Correctness tables: fgchat on real weights against transformers and float32.

    python3 scripts/check_real_weights.py --model PATH.gguf [--tokens 16] [--json OUT.json]
    python3 scripts/check_real_weights.py --device cpu [--model M] [--tokens 32]

What it runs: fgchat.bench.real_weights (eight chat prompts; CUDA: bf16 and fp16, every mode;
CPU: float32 and bf16, eager, each also against transformers' float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from fgchat.bench.real_weights import equal_to, print_table, run_all, run_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="CUDA: required; CPU: default the embedded model")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt (16 CUDA, 32 CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        result = run_cpu(args.model, args.tokens or 32)
    elif args.model is None:
        ap.error("--model is required on CUDA")
    else:
        result = run_all(args.model, args.tokens or 16)
    print_table(result)
    if args.device == "cpu":
        for run in (k for k in result["runs"] if k.startswith("fgchat")):
            print(f"  {run} equals transformers float32 on {equal_to(result, run, 'transformers float32')}/8")
        print(f"  transformers bfloat16 equals transformers float32 on "
              f"{equal_to(result, 'transformers bfloat16', 'transformers float32')}/8")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1,
                      default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))


if __name__ == "__main__":
    main()
