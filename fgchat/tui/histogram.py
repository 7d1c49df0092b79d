"""Per-token latency histograms, one per mode, drawn on one shared millisecond axis.

Each mode gets a band of vertical bars (bins left to right, one character per bin); all bands use
the same bin edges, so a faster mode's mass sits visibly further left. Heights scale to each mode's
own peak (shapes compare; counts are printed as n=).

The axis is robust to outliers (`robust_edges`): it spans the series' 1st..99th percentiles, and
when values lie far beyond that the right-most column becomes an overflow bin counting them
(labelled "> 12.3 ms: 2" under the axis), so one long gap never squashes every other sample into
the first bins. Counts always sum to the number of samples shown.
"""

from __future__ import annotations

from collections.abc import Mapping

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
# values up to this much of the percentile span beyond p99 (p1) just widen the axis; further out
# they go to the overflow bin (or the first bin, below)
SLACK = 0.5


def robust_edges(series: Mapping[str, np.ndarray], bins: int) -> tuple[np.ndarray, bool]:
    """Bin edges for `bins` columns shared by all series, and whether the last column is an
    overflow bin (its right edge is then +inf: it counts every value beyond the axis).

    The axis spans the lowest per-series p1 to the highest per-series p99 (per series, so a slow
    mode with few samples is never clipped away by a fast one with many); values within SLACK of
    that span beyond it widen the axis instead, so a plain tail is not called overflow (only values
further out than that land in the overflow bin).
    """
    arrays = [a[np.isfinite(a)] for a in (np.asarray(v, dtype=np.float64) for v in series.values())]
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return np.linspace(0.0, 1.0, bins + 1), False
    vmin = min(float(a.min()) for a in arrays)
    vmax = max(float(a.max()) for a in arrays)
    lo = min(float(np.percentile(a, LOW_PCT)) for a in arrays)
    hi = max(float(np.percentile(a, HIGH_PCT)) for a in arrays)
    span = hi - lo
    if vmin >= lo - SLACK * span:
        lo = vmin
    cut = hi + SLACK * span
    overflow = vmax > cut and bins >= 2
    if overflow:  # the axis ends at the largest value that is not far out: only those overflow
        hi = max(float(a[a <= cut].max(initial=hi)) for a in arrays)
    else:
        hi = vmax
    if not hi > lo:  # a single distinct value: give it a visible width around itself
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, lo + pad
    n = bins - 1 if overflow else bins
    edges = np.linspace(lo, hi, n + 1)
    if not np.all(np.diff(edges) > 0):  # float resolution exhausted (huge magnitude, tiny span)
        edges = lo + np.arange(n + 1, dtype=np.float64) * max(abs(lo), 1.0) * 1e-9
    if overflow:
        edges = np.append(edges, np.inf)
    return edges, overflow


def binned(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Counts per bin; values below the first edge count in the first bin, above the last in the
    last (with an overflow bin, that is the overflow)."""
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    finite_hi = edges[-2] if np.isinf(edges[-1]) else edges[-1]
    if np.isinf(edges[-1]):
        over = int((arr > finite_hi).sum())
        inner = histogram(arr[arr <= finite_hi], edges[:-1]) if arr.size else np.zeros(len(edges) - 2, np.int64)
        return np.append(inner, over).astype(np.int64)
    return histogram(arr, edges)


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


def column_rows(counts: np.ndarray, rows: int) -> list[str]:
    """Vertical bars, top row first; each bin one character; every non-zero count shows."""
    peak = float(counts.max(initial=0))
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
        self.edges: np.ndarray | None = None  # last drawn edges (+inf last with an overflow bin)
        self.overflow: dict[str, int] = {}  # samples per mode beyond the axis (in the overflow bin)
        self._height = 0  # lines of the last render

    def set_data(
        self, series: Mapping[str, np.ndarray], unavailable: Mapping[str, str], current_mode: str,
        chosen_mode: str = "",
    ) -> None:
        """current_mode: the mode of the latest step (marked ▶); chosen_mode: the engine's chosen
        one, marked ▷ where it differs."""
        self.series = {m: np.asarray(series.get(m, np.empty(0)), dtype=np.float64) for m in MODES}
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
        edges, has_overflow = robust_edges(populated, bins) if populated else (None, False)
        self.edges = edges
        self.overflow = {m: 0 for m in MODES}
        lines: list[Content] = []
        for mode in MODES:
            values = self.series[mode]
            style = MODE_STYLES[mode]
            marker = "▶" if mode == self.current_mode else "▷" if mode == self.chosen_mode else " "
            labels = [f"{marker}{mode}"[:LABEL_WIDTH], f" n={compact_count(values.size)}"]
            if edges is not None and values.size:
                counts = binned(values, edges)
                self.counts[mode] = counts
                if has_overflow:
                    self.overflow[mode] = int(counts[-1])
                bars = column_rows(counts, rows)
            else:
                self.counts[mode] = np.zeros(bins, dtype=np.int64)
                reason = "n/a on this device" if self.unavailable.get(mode) else "no tokens yet"
                bars = [" " * bins for _ in range(rows)]
                bars[-1] = ("·" * 2 + " " + reason)[:bins].ljust(bins)
            for r, bar in enumerate(bars):
                if rows == 1:
                    label = f"{marker}{_SHORT[mode]:<5}{compact_count(values.size):>4} "
                else:
                    label = labels[r] if r < len(labels) else ""
                label_style = f"bold {style}" if mode == self.current_mode else style
                dim = "" if values.size else "$text-muted"
                bar_parts: list[tuple[str, str]] = [(bar, dim or style)]
                if has_overflow and values.size:  # the overflow column stands out
                    bar_parts = [(bar[:-1], style), (bar[-1:], f"bold {style} reverse" if bar[-1] != " " else "")]
                lines.append(
                    Content.assemble((label[:LABEL_WIDTH].ljust(LABEL_WIDTH), label_style), *bar_parts)
                )
        lines.append(self._axis(edges, bins, has_overflow))
        if has_overflow:
            lines.append(self._overflow_line(edges, bins))
        if len(lines) != self._height:  # the overflow line came or went (or rows changed)
            self._height = len(lines)
            self.call_later(self.refresh, layout=True)
        return Content("\n").join(lines)

    def overflow_label(self) -> str:
        """"> 12.3 ms: 2" (all modes together), or "" when nothing is beyond the axis."""
        total = sum(self.overflow.values())
        if not total or self.edges is None or not np.isinf(self.edges[-1]):
            return ""
        return f"> {fmt_ms(float(self.edges[-2]))} ms: {total}"

    def _overflow_line(self, edges: np.ndarray, bins: int) -> Content:
        text = self.overflow_label()
        width = LABEL_WIDTH + bins
        return Content.assemble((text.rjust(width)[-width:], "bold $warning"))

    def _axis(self, edges: np.ndarray | None, bins: int, overflow: bool = False) -> Content:
        if edges is None:
            return Content.assemble(("ITL ms".ljust(LABEL_WIDTH), "$text-muted"), ("─" * bins, "$text-muted"))
        finite = edges[:-1] if overflow else edges
        span = bins - 1 if overflow else bins
        lo, hi = fmt_ms(float(finite[0])), fmt_ms(float(finite[-1]))
        mid = fmt_ms(float(finite[len(finite) // 2]))
        fill = span - len(lo) - len(hi)
        if fill >= len(mid) + 4:
            left = (fill - len(mid)) // 2
            axis = lo + "─" * left + mid + "─" * (fill - len(mid) - left) + hi
        else:
            axis = lo + "─" * max(fill, 1) + hi
        axis = axis[:span] + ("»" if overflow else "")
        return Content.assemble(("ITL ms".ljust(LABEL_WIDTH), "$text-muted"), (axis, "$text-muted"))
