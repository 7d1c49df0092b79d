"""The bench report with several weight sets: each set's rows compare with its own eager rows, the
table shows the weights column only when they vary and the share of peak bandwidth when known,
each run block its own graphs and bytes; runner labels name the set."""

from __future__ import annotations

import io

from fgchat.bench.report import print_report, summary_rows, summary_table, weight_lines
from fgchat.bench.runner import label_run, weights_label

PEAK = 3.35e12


def _run(mode: str, batch: int, tpot: float, gpu: float | None) -> dict:
    run = {"runner": f"fgchat-{mode}", "mode": mode, "batch_size": batch, "requests": batch,
           "output_tokens_per_s": 1000.0 / tpot, "host_overhead_ms": 0.01, "decode_modes": [mode]}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "gpu_step_ms", "launch_ms"):
        run[key] = {"mean": tpot, "median": tpot, "p90": tpot, "p99": tpot}
    run["gpu_step_ms"]["mean"] = gpu
    run["launch_ms"]["mean"] = 0.1
    return run


SETS = [{"quantize": "none", "label": "", "weights": "bf16", "weight_bytes": 2_600_000_000,
         "step_bytes": 2_470_000_000, "startup_check": None},
        {"quantize": "int4", "label": "int4", "weights": "int4+bf16", "weight_bytes": 1_000_000_000,
         "step_bytes": 870_000_000, "startup_check": None}]


def _result() -> dict:
    runs = []
    for ws, scale in zip(SETS, (1.0, 0.5)):
        for mode, t in (("eager", 2.0), ("full", 1.0)):
            runs.append(label_run(_run(mode, 1, t * scale, t * scale * 0.9), ws, PEAK))
    caps = [{"mode": "full", "batch_size": 1, "seconds": 0.5, "pool_mib": 3.0, "kind": "decode", "weights_label": ""},
            {"mode": "full", "batch_size": 1, "seconds": 0.25, "pool_mib": 1.0, "kind": "decode",
             "weights_label": "int4"}]
    meta = {"model": "m", "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "attention": "triton",
            "prompt_len": 512, "output_len": 128, "commit": "abc", "weight_sets": SETS, "peak_bandwidth": PEAK}
    return {"meta": meta, "runs": runs, "captures": caps, "skipped": []}


def test_labels():
    assert weights_label("none", "bf16") == "" and weights_label("none", "fp16") == ""
    assert weights_label("int4", "bf16") == "int4"  # a CPU runs dequantized copies: still labelled
    assert weights_label("none", "Q4_K+Q6_K") == "Q4_K+Q6_K"


def test_each_set_against_its_own_eager_and_the_bandwidth_share():
    result = _result()
    assert [r["runner"] for r in result["runs"]] == ["fgchat-eager", "fgchat-full", "fgchat-eager-int4",
                                                     "fgchat-full-int4"]
    rows = summary_rows(result)
    assert [r["speedup_vs_fgchat-eager"] for r in rows] == [1.0, 2.0, 1.0, 2.0]
    for row, run in zip(rows, result["runs"]):
        ws = SETS[run["runner"].endswith("int4")]
        gpu_s = run["gpu_step_ms"]["mean"] / 1000
        assert abs(row["bandwidth_share"] / (ws["step_bytes"] / gpu_s / PEAK) - 1) < 1e-12
        assert row["weights"] == ws["weights"]


def _table_text(rows) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(rows))
    return out.getvalue()


def test_weights_column_only_when_they_vary():
    rows = summary_rows(_result())
    text = _table_text(rows)
    assert "weights" in text and "int4+bf16" in text and "BW %" in text
    share = rows[1]["bandwidth_share"]
    assert f"{100 * share:.0f}%" in text
    one_set = [r for r in rows if r["weights"] == "bf16"]
    assert "weights" not in _table_text(one_set)
    for r in one_set:
        r["bandwidth_share"] = None
    assert "BW %" not in _table_text(one_set)


def test_report_blocks_and_header():
    out = io.StringIO()
    print_report(_result(), out)
    text = out.getvalue()
    assert weight_lines(_result()["meta"]) == [
        "weights bf16: 2600.0 MB, a decode step reads 2470.0 MB",
        "weights int4+bf16 (--quantize int4): 1000.0 MB, a decode step reads 870.0 MB",
        "peak memory bandwidth: 3.35 TB/s"]
    assert "\n".join(weight_lines(_result()["meta"])) in text
    block = text.split("fgchat-full-int4 | batch 1")[1]
    assert "Graph capture (s):                           0.250" in block  # its own set's graph
    assert "Weight bytes read per step (MB):             870.0\n" in block
    assert f"Share of peak memory bandwidth (%):{100 * 870e6 / 0.45e-3 / PEAK:>15.1f}\n" in block
    plain = text.split("fgchat-full | batch 1")[1]
    assert "Graph capture (s):                           0.500" in plain
