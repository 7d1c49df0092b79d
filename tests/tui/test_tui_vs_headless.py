"""scripts/tui_vs_headless.py end to end on CPU with a tiny model: every way starts, the rounds
interleave, the app's replies are all logged (the next prompt waits until the app takes it), and
the RESULT line carries each way's ITL and its ratio to the first way."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual")

REPO = Path(__file__).resolve().parents[2]


def test_every_way_measures_and_the_result_line_has_the_ratios(tiny_llama):
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tui_vs_headless.py"), "full", "2", f"--model={tiny_llama}",
         "--ways=headless,thread,child,tui", "--tokens=12", "--rounds=2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert len(result) == 1, out.stdout
    values = dict(re.findall(r"(\w+(?:/\w+)?)=([0-9.]+)", result[0]))
    for way in ("headless", "thread", "child", "tui"):
        assert float(values[f"{way}_ms"]) > 0, values
    for way in ("thread", "child", "tui"):
        ratio = float(values[f"{way}/headless"])
        # the printed ratio has 3 decimals: its rounding is 5e-4 at most, whatever its size
        assert ratio == pytest.approx(float(values[f"{way}_ms"]) / float(values["headless_ms"]), rel=2e-3, abs=6e-4)
        assert float(values[f"{way}/headless_paired"]) > 0, values
    assert "tui: UI process CPU" in out.stdout


def test_unknown_ways_are_one_line_errors(tiny_llama):
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tui_vs_headless.py"), "full", "1", f"--model={tiny_llama}",
         "--ways=headless,gpu"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "--ways" in out.stderr and "Traceback" not in out.stderr
