"""The bench summary table: empty columns dropped, the ratio direction named, 80 columns fit."""

from __future__ import annotations

import io

from rich.console import Console

from fgchat.bench.report import summary_rows, summary_table


def _run(runner: str, b: int, tpot: float, gpu: float | None) -> dict:
    return {"runner": runner, "batch_size": b, "tpot_ms": {"mean": tpot}, "ttft_ms": {"median": 5.0},
            "itl_ms": {"p99": tpot * 1.5}, "output_tokens_per_s": 1000 / tpot * b,
            "gpu_step_ms": {"mean": gpu}, "launch_ms": {"mean": 0.5}}


def _render(rows: list[dict], width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(summary_table(rows))
    return buf.getvalue()


def test_cpu_summary_drops_empty_columns_and_fits_80_columns():
    rows = summary_rows({"runs": [_run("fgchat-eager", 1, 30.0, None), _run("fgchat-eager", 8, 90.0, None)]})
    text = _render(rows, 80)
    assert "GPU ms/step" not in text and "hf-compile" not in text and "piecewise" not in text
    assert "× eager" in text and "this row is faster" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_ratio_is_other_tpot_over_this_tpot():
    rows = summary_rows({"runs": [_run("fgchat-eager", 1, 3.0, 2.0), _run("fgchat-full", 1, 1.0, 0.9)]})
    full = next(r for r in rows if r["runner"] == "fgchat-full")
    assert full["speedup_vs_fgchat-eager"] == 3.0
    text = _render(rows, 160)
    assert "3.00x" in text and "GPU ms/step" in text
