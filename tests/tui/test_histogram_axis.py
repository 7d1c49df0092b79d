"""The histograms' axis follows the recent window: slow tokens of a cold start do not squash the
session's real inter-token latencies into the first column; they are counted at the axis' edge
(an overflow bin labelled under the axis), or, while they are still within the window, the axis
is logarithmic so the bulk keeps several columns. Values far below the recent window are counted
in an underflow bin the same way. Counts always sum to the samples shown."""

from __future__ import annotations

import numpy as np
import pytest
from textual.app import App

from fgchat.tui.histogram import AXIS_WINDOW, ModeHistograms, robust_edges

pytestmark = pytest.mark.timeout(60)
COLD = [1_000.0, 1_387.0, 1_150.0, 990.0] * 5  # a cold start's tokens: 20 slow ones


class Host(App):
    def compose(self):
        yield ModeHistograms()


async def drawn(series: dict[str, np.ndarray]) -> ModeHistograms:
    app = Host()
    async with app.run_test(size=(60, 12)) as pilot:
        hist = app.query_one(ModeHistograms)
        hist.set_data(series, {}, "eager")
        await pilot.pause(0.05)
        hist.text = hist.render().plain
    return hist


def real_columns(hist: ModeHistograms, mode: str = "eager") -> int:
    """Columns holding the 18-60 ms tokens (the edge bins excluded)."""
    axis, counts = hist.axis, hist.counts[mode]
    edges = axis.finite
    inner = counts[int(axis.underflow): len(counts) - int(axis.overflow)]
    lows = edges[:-1]
    return int(((inner > 0) & (lows >= 17.0) & (lows <= 60.0)).sum())


async def test_cold_start_outliers_are_counted_at_the_edge():
    rng = np.random.default_rng(3)
    values = np.append(COLD, rng.uniform(18.0, 60.0, AXIS_WINDOW + 100))
    hist = await drawn({"eager": values})
    assert hist.axis.overflow and hist.axis.finite[-1] < 100
    assert hist.overflow["eager"] == len(COLD)
    assert hist.overflow_label().startswith("> ") and hist.overflow_label().endswith(f" ms: {len(COLD)}")
    assert hist.overflow_label() in hist.text
    assert int(hist.counts["eager"].sum()) == values.size
    assert real_columns(hist) >= 30  # of 49: the real ones spread over the axis


async def test_cold_start_within_the_window_gets_a_log_axis():
    rng = np.random.default_rng(4)
    values = np.append(COLD, rng.uniform(18.0, 60.0, 200))
    hist = await drawn({"eager": values})
    assert hist.axis.log and "ITL ms log" in hist.text
    assert int(hist.counts["eager"].sum()) == values.size
    assert hist.counts["eager"][-1] > 0 and hist.axis.finite[-1] >= 1_387.0  # the slow ones, counted
    assert real_columns(hist) >= 10


async def test_older_faster_tokens_go_to_an_underflow_bin():
    rng = np.random.default_rng(5)
    values = np.append(rng.uniform(20.0, 22.0, 300), rng.uniform(100.0, 110.0, AXIS_WINDOW))
    hist = await drawn({"eager": values})
    axis = hist.axis
    assert axis.underflow and not axis.overflow and not axis.log and axis.finite[0] >= 95
    assert hist.underflow["eager"] == 300 and hist.overflow_label().startswith("< ")
    assert hist.overflow_label().endswith(" ms: 300") and hist.text.splitlines()[-2][11] == "«"
    assert int(hist.counts["eager"].sum()) == values.size


def test_a_mode_of_its_own_keeps_its_place_on_the_shared_axis():
    """Per series: a slow mode with a few samples is on the axis, not counted as overflow."""
    rng = np.random.default_rng(6)
    axis = robust_edges({"full": rng.uniform(2.0, 3.0, 2_000), "eager": rng.uniform(11.0, 13.0, 30)}, 40)
    assert not axis.overflow and not axis.underflow and axis.finite[-1] >= 12.9
