"""tools/peer_chart.py: llama.cpp rows become a runner of the same preset's panel."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from peer_chart import llamacpp_results  # noqa: E402

from fgchat.bench.chart import bar_chart_svg  # noqa: E402


def _bench(model: str) -> dict:
    return {"meta": {"model": f"{model} (random weights)", "device": "GPU X", "dtype": "bfloat16"},
            "runs": [{"runner": "fgchat-full", "batch_size": b, "tpot_ms": {"mean": 0.5 * b}} for b in (1, 8)]}


def test_rows_of_the_dtype_join_their_presets_panel():
    rows = [{"preset": "p1", "dtype": "bf16", "batch_size": 1, "tpot_ms": 1.0, "tpot_ms_runs": [1.0, 2.0]},
            {"preset": "p1", "dtype": "f16", "batch_size": 1, "tpot_ms": 9.0},
            {"preset": "p2", "dtype": "bf16", "batch_size": 8, "tpot_ms": 3.0},  # no fgchat result: left out
            {"preset": "p1", "dtype": "bf16", "batch_size": 8, "tpot_ms": 2.5}]
    peers = llamacpp_results(rows, "bf16", [_bench("p1")])
    assert len(peers) == 1
    (p,) = peers
    assert p["meta"]["model"] == "p1 (random weights)" and p["meta"]["device"] == "GPU X"
    assert [(r["runner"], r["batch_size"], r["tpot_ms"]["mean"]) for r in p["runs"]] == [
        ("llama.cpp bf16", 1, 1.5), ("llama.cpp bf16", 8, 2.5)]
    svg = bar_chart_svg([_bench("p1"), p])
    assert svg.count(">ms per decode step<") == 1 and "llama.cpp bf16" in svg  # one panel
