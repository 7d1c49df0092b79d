"""Per-token latency histograms, one per mode, drawn on one shared millisecond axis.

Each mode gets a band of vertical bars (bins left to right, one character per bin); all bands use
the same bin edges, so a faster mode's mass sits visibly further left. Heights scale to each mode's
own peak within the axis (shapes compare; counts are printed as n=; edge bins draw at most full).

The axis follows the recent window and is robust to outliers (`robust_edges`): it spans the 1st..99th
percentiles of each series' latest AXIS_WINDOW values, so slow tokens of a cold start stop setting
it once they are older than that. Values far beyond it (older ones included) are counted at the
edges: the right-most column becomes an overflow bin, the left-most an underflow bin (labelled
"< 3.10 ms: 4 · > 61.2 ms: 20" under the axis). An axis that still spans a ratio of LOG_RATIO or
more (slow tokens within the window) is logarithmic ("ITL ms log"), so the bulk keeps several
columns. Counts always sum to the number of samples shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from fgchat.protocol.events import MODES, Mode
from fgchat.metrics import histogram

MODE_STYLES: dict[str, str] = {Mode.EAGER: "$error", Mode.PIECEWISE: "$warning", Mode.FULL: "$success",
                               Mode.MEGA: "$accent"}
_V_BLOCKS = "▁▂▃▄▅▆▇█"
LABEL_WIDTH = 11
_SHORT = {Mode.EAGER: "eager", Mode.PIECEWISE: "piece", Mode.FULL: "full", Mode.MEGA: "mega"}
LOW_PCT, HIGH_PCT = 1.0, 99.0
AXIS_WINDOW = 500  # the axis follows each series' latest values (its percentiles come from these)
# values up to this much of the percentile span beyond p99 (p1) just widen the axis; further out
# they go to the overflow (underflow) bin
SLACK = 0.5
MIN_SPAN = 0.1  # the span the slack is taken of is at least this fraction of p99 (a flat window)
LOG_RATIO = 8.0  # an axis whose ends differ by this factor or more is logarithmic


class Axis(NamedTuple):
    """Bin edges shared by all series: -inf first with an underflow bin, +inf last with an
    overflow bin; the finite edges are evenly spaced, geometrically when `log`."""

    edges: np.ndarray
    underflow: bool
    overflow: bool
    log: bool

    @property
    def finite(self) -> np.ndarray:
        return self.edges[int(self.underflow): len(self.edges) - int(self.overflow)]


def robust_edges(series: Mapping[str, np.ndarray], bins: int, recent: int = AXIS_WINDOW) -> Axis:
    """The axis for `bins` columns shared by all series (oldest value first in each).

    The axis spans the lowest per-series p1 to the highest per-series p99 of each series' latest
    `recent` values (per series, so a slow mode with few samples is never clipped away by a fast
    one with many); values within SLACK of that span beyond it widen the axis instead, so a plain
    tail is not called overflow (only values further out land in the edge bins).
    """
    arrays = [a[np.isfinite(a)] for a in (np.asarray(v, dtype=np.float64) for v in series.values())]
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return Axis(np.linspace(0.0, 1.0, bins + 1), False, False, False)
    tails = [a[-recent:] for a in arrays]
    lo = min(float(np.percentile(t, LOW_PCT)) for t in tails)
    hi = max(float(np.percentile(t, HIGH_PCT)) for t in tails)
    span = max(hi - lo, MIN_SPAN * abs(hi))
    low_cut, high_cut = lo - SLACK * span, hi + SLACK * span
    underflow = min(float(a.min()) for a in arrays) < low_cut and bins >= 3
    overflow = max(float(a.max()) for a in arrays) > high_cut and bins >= 2 + underflow
    # the axis ends at the most extreme values that are not far out: only those are counted outside
    lo = min(float(a[a >= low_cut].min(initial=lo)) if underflow else float(a.min()) for a in arrays)
    hi = max(float(a[a <= high_cut].max(initial=hi)) if overflow else float(a.max()) for a in arrays)
    if not hi > lo:  # a single distinct value: give it a visible width around itself
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, lo + pad
    n = bins - int(underflow) - int(overflow)
    log = lo > 0 and hi / lo >= LOG_RATIO
    edges = np.geomspace(lo, hi, n + 1) if log else np.linspace(lo, hi, n + 1)
    if not np.all(np.diff(edges) > 0):  # float resolution exhausted (huge magnitude, tiny span)
        edges = lo + np.arange(n + 1, dtype=np.float64) * max(abs(lo), 1.0) * 1e-9
    edges = np.concatenate([[-np.inf]] * underflow + [edges] + [[np.inf]] * overflow)
    return Axis(edges, underflow, overflow, log)


def binned(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Counts per bin; with an underflow (overflow) bin, it counts every value below (above) the
    finite edges; without one, such values count in the first (last) bin."""
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    under, over = bool(np.isneginf(edges[0])), bool(np.isposinf(edges[-1]))
    finite = edges[int(under): len(edges) - int(over)]
    keep = np.ones(arr.shape, dtype=bool)
    if under:
        keep &= arr >= finite[0]
    if over:
        keep &= arr <= finite[-1]
    counts = [histogram(arr[keep], finite)]
    if under:
        counts.insert(0, [int((arr < finite[0]).sum())])
    if over:
        counts.append([int((arr > finite[-1]).sum())])
    return np.concatenate(counts).astype(np.int64)


def fmt_ms(value: float | None) -> str:
    """Milliseconds in at most 6 characters: 0.123, 12.34, 123.4, 1234."""
    if value is None or not np.isfinite(value):
        return "–"
    v = float(value)
    if abs(v) < 10:
        return f"{v:.2f}"
    if abs(v) < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def compact_count(n: int) -> str:
    """Counts in at most 4 characters: 999, 1.2k, 12k, 1.2M."""
    if n < 1000:
        return str(n)
    if n < 10_000:
        return f"{n / 1000:.1f}k"
    if n < 1_000_000:
        return f"{n // 1000}k"
    return f"{n / 1e6:.1f}M"


def column_rows(counts: np.ndarray, rows: int, peak: float | None = None) -> list[str]:
    """Vertical bars, top row first; each bin one character; every non-zero count shows.
    Heights scale to `peak` (default the largest count); a count above it draws full height."""
    peak = float(counts.max(initial=0)) if peak is None else float(peak)
    lines = [[" "] * len(counts) for _ in range(rows)]
    if peak <= 0:
        return ["".join(line) for line in lines]
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        eighths = max(1, int(round(float(c) / peak * rows * 8)))
        for r in range(rows):  # r = 0 is the bottom row
            level = min(8, eighths - r * 8)
            if level > 0:
                lines[rows - 1 - r][i] = _V_BLOCKS[level - 1]
    return ["".join(line) for line in lines]


class ModeHistograms(Widget):
    """Histogram of inter-token latency per mode; call `set_data` with ITL arrays per mode."""

    DEFAULT_CSS = """
    ModeHistograms { height: auto; width: 1fr; }
    """

    rows_per_mode: reactive[int] = reactive(1, layout=True)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.series: dict[str, np.ndarray] = {m: np.empty(0) for m in MODES}
        self.unavailable: dict[str, str] = {}
        self.current_mode: str = ""
        self.chosen_mode: str = ""
        self.counts: dict[str, np.ndarray] = {}  # last drawn counts per mode (tests, export)
        self.axis: Axis | None = None  # last drawn axis
        self.overflow: dict[str, int] = {}  # samples per mode beyond the axis (in the overflow bin)
        self.underflow: dict[str, int] = {}  # samples per mode below the axis (in the underflow bin)
        self._height = 0  # lines of the last render

    def set_data(
        self, series: Mapping[str, np.ndarray], unavailable: Mapping[str, str], current_mode: str,
        chosen_mode: str = "",
    ) -> None:
        """current_mode: the mode of the latest step (marked ▶); chosen_mode: the engine's chosen
        one, marked ▷ where it differs. Bands: the engine's modes, then any other label with data
        (an endpoint's `remote`)."""
        shown = [*MODES, *(m for m in series if m not in MODES and len(series[m]))]
        self.series = {m: np.asarray(series.get(m, np.empty(0)), dtype=np.float64) for m in shown}
        self.unavailable = dict(unavailable)
        self.current_mode = current_mode
        self.chosen_mode = chosen_mode or current_mode
        self.refresh()  # a repaint; `render` asks for a layout when the height changes

    @property
    def total(self) -> int:
        return int(sum(len(v) for v in self.series.values()))

    def render(self) -> Content:
        # outer_size, not size: no gutter here, and `size` asks the compositor for this widget's
        # region, which rebuilds the whole screen's map after any off-screen widget changed
        width = max(self.outer_size.width, LABEL_WIDTH + 8)
        bins = max(4, width - LABEL_WIDTH)
        rows = max(1, self.rows_per_mode)
        populated = {m: v for m, v in self.series.items() if v.size}
        axis = self.axis = robust_edges(populated, bins) if populated else None
        self.overflow = {m: 0 for m in self.series}
        self.underflow = {m: 0 for m in self.series}
        lines: list[Content] = []
        for mode in self.series:
            values = self.series[mode]
            style = MODE_STYLES.get(mode, "$primary")
            marker = "▶" if mode == self.current_mode else "▷" if mode == self.chosen_mode else " "
            labels = [f"{marker}{mode}"[:LABEL_WIDTH], f" n={compact_count(values.size)}"]
            if axis is not None and values.size:
                counts = binned(values, axis.edges)
                self.counts[mode] = counts
                if axis.overflow:
                    self.overflow[mode] = int(counts[-1])
                if axis.underflow:
                    self.underflow[mode] = int(counts[0])
                inner = counts[int(axis.underflow): len(counts) - int(axis.overflow)]
                # heights scale to the axis' own bins: an edge bin's count is printed, not scaled
                bars = column_rows(counts, rows, int(inner.max(initial=0)) or None)
            else:
                self.counts[mode] = np.zeros(bins, dtype=np.int64)
                reason = "n/a on this device" if self.unavailable.get(mode) else "no tokens yet"
                bars = [" " * bins for _ in range(rows)]
                bars[-1] = ("·" * 2 + " " + reason)[:bins].ljust(bins)
            for r, bar in enumerate(bars):
                if rows == 1:
                    label = f"{marker}{_SHORT.get(mode, mode[:5]):<5}{compact_count(values.size):>4} "
                else:
                    label = labels[r] if r < len(labels) else ""
                label_style = f"bold {style}" if mode == self.current_mode else style
                bar_parts = self._bar_parts(bar, style, axis) if axis and values.size else [(bar, "$text-muted")]
                lines.append(
                    Content.assemble((label[:LABEL_WIDTH].ljust(LABEL_WIDTH), label_style), *bar_parts)
                )
        lines.append(self._axis(axis, bins))
        if axis is not None and (axis.overflow or axis.underflow):
            lines.append(self._overflow_line(bins))
        if len(lines) != self._height:  # the overflow line came or went (or rows changed)
            self._height = len(lines)
            self.call_later(self.refresh, layout=True)
        return Content("\n").join(lines)

    @staticmethod
    def _bar_parts(bar: str, style: str, axis: Axis) -> list[tuple[str, str]]:
        """A mode's bars with the underflow / overflow columns standing out."""
        edge_style = f"bold {style} reverse"
        first, last = int(axis.underflow), len(bar) - int(axis.overflow)
        parts = [(bar[:first], edge_style if bar[:first].strip() else ""), (bar[first:last], style),
                 (bar[last:], edge_style if bar[last:].strip() else "")]
        return [part for part in parts if part[0]]

    def overflow_label(self) -> str:
        """"< 3.10 ms: 4 · > 12.3 ms: 2" (all modes together; each part only when that edge bin
        counts something), or "" when nothing is outside the axis."""
        axis = self.axis
        if axis is None:
            return ""
        finite = axis.finite
        under, over = sum(self.underflow.values()), sum(self.overflow.values())
        parts = ([f"< {fmt_ms(float(finite[0]))} ms: {under}"] if axis.underflow and under else []) + \
            ([f"> {fmt_ms(float(finite[-1]))} ms: {over}"] if axis.overflow and over else [])
        return " · ".join(parts)

    def _overflow_line(self, bins: int) -> Content:
        text = self.overflow_label()
        width = LABEL_WIDTH + bins
        return Content.assemble((text.rjust(width)[-width:], "bold $warning"))

    def _axis(self, axis: Axis | None, bins: int) -> Content:
        if axis is None:
            return Content.assemble(("ITL ms".ljust(LABEL_WIDTH), "$text-muted"), ("─" * bins, "$text-muted"))
        finite = axis.finite
        span = bins - int(axis.underflow) - int(axis.overflow)
        lo, hi = fmt_ms(float(finite[0])), fmt_ms(float(finite[-1]))
        mid = fmt_ms(float(finite[len(finite) // 2]))
        fill = span - len(lo) - len(hi)
        if fill >= len(mid) + 4:
            left = (fill - len(mid)) // 2
            line = lo + "─" * left + mid + "─" * (fill - len(mid) - left) + hi
        else:
            line = lo + "─" * max(fill, 1) + hi
        line = ("«" if axis.underflow else "") + line[:span] + ("»" if axis.overflow else "")
        title = "ITL ms log" if axis.log else "ITL ms"
        return Content.assemble((title.ljust(LABEL_WIDTH), "$text-muted"), (line, "$text-muted"))
