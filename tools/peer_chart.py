"""One bar chart (SVG) of fgchat bench results with llama.cpp's rows from `scripts/llama_cpp.sh
bench` (its llamacpp.json) as one more runner in the panel of the same preset.

Usage: python tools/peer_chart.py --llamacpp llamacpp.json [--dtype bf16] [--skip RUNNER,...] --chart OUT.svg
       BENCH.json...
(BENCH.json: `fgchat bench --preset P --random-weights --json` results; llama.cpp rows of a
preset without one are left out, as are rows of other weight dtypes)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fgchat.bench.chart import load_results  # noqa: E402
from fgchat.bench.cli import write_chart  # noqa: E402
from fgchat.protocol.errors import FgchatError  # noqa: E402


def llamacpp_results(rows: list[dict[str, Any]], dtype: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama.cpp rows of `dtype` as bench results, one per preset that `results` measured."""
    metas = {str(r["meta"].get("model", "")).removesuffix(" (random weights)"): r["meta"] for r in results}
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        meta = metas.get(row.get("preset"))
        if meta is None or row.get("dtype") != dtype:
            continue
        result = out.setdefault(row["preset"], {"meta": {
            "model": meta["model"], "device": meta.get("device"), "dtype": meta.get("dtype"),
            "commit": f"llama.cpp {str(row.get('commit', ''))[:7]}", "prompt_len": row.get("prompt_len"),
            "output_len": row.get("output_len")}, "runs": []})
        runs = [float(x) for x in row.get("tpot_ms_runs") or [row["tpot_ms"]]]
        result["runs"].append({"runner": f"llama.cpp {dtype}", "batch_size": int(row["batch_size"]),
                               "tpot_ms": {"mean": sum(runs) / len(runs)}})
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp", required=True, type=Path)
    ap.add_argument("--dtype", default="bf16", help="llama.cpp weight dtype to draw (default bf16)")
    ap.add_argument("--chart", required=True, type=Path)
    ap.add_argument("--skip", default="", help="runners left out of the chart, comma separated (e.g. hf-eager, "
                    "whose bars would flatten the others)")
    ap.add_argument("bench", nargs="+")
    a = ap.parse_args()
    try:
        results = load_results(a.bench)
        skip = {r.strip() for r in a.skip.split(",") if r.strip()}
        for r in results:
            r["runs"] = [run for run in r["runs"] if run["runner"] not in skip]
        rows = json.loads(a.llamacpp.read_text())
        peers = llamacpp_results(rows, a.dtype, results)
        if not peers:
            raise FgchatError(f"{a.llamacpp}: no {a.dtype} rows of the benched presets")
        merged = []
        for r in results:  # each preset's llama.cpp result right after its first fgchat result
            merged.append(r)
            name = r["meta"].get("model")
            merged += [p for p in peers if p["meta"]["model"] == name and p not in merged]
        write_chart(merged, a.chart)
    except (FgchatError, OSError, ValueError, KeyError) as exc:
        sys.exit(f"peer_chart: {exc}")


if __name__ == "__main__":
    main()
