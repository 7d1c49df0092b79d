"""Markdown table from `fgchat bench --json` files: python tools/bench_table.py a.json [b.json ...]"""

from __future__ import annotations

import json
import sys


def fmt(v, nd=3):
    return "–" if v is None else f"{v:.{nd}f}"


def main(paths: list[str]) -> None:
    print("| model | runner | batch | TTFT p50 ms | TPOT ms | ITL p99 ms | GPU ms/step | tok/s | vs eager | vs piecewise | vs hf-eager | vs hf-compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        d = json.load(open(p))
        name = d["meta"]["model"].replace(" (random weights)", "")
        if not d["meta"].get("fused_kernels", True):
            name += " (unfused)"
        for r in d["summary"]:
            ratios = [r.get(f"speedup_vs_{k}") for k in ("fgchat-eager", "fgchat-piecewise", "hf-eager", "hf-compile")]
            print(f"| {name} | {r['runner']} | {r['batch_size']} | {fmt(r['ttft_ms_median'], 2)} | "
                  f"{fmt(r['tpot_ms_mean'])} | {fmt(r['itl_ms_p99'])} | {fmt(r['gpu_step_ms_mean'])} | "
                  f"{fmt(r['output_tokens_per_s'], 0)} | " + " | ".join("–" if x is None else f"{x:.2f}x" for x in ratios) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
