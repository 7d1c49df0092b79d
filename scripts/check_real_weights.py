"""The README's Correctness table: fgchat on real weights against transformers and float32 (CUDA).

    python3 scripts/check_real_weights.py --model PATH.gguf [--tokens 16] [--json OUT.json]

What it runs: fgchat.bench.real_weights (eight chat prompts, bf16 and fp16, every mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from fgchat.bench.real_weights import print_table, run_all


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = run_all(args.model, args.tokens)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1,
                      default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))


if __name__ == "__main__":
    main()
