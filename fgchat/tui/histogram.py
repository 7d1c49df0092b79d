"""Per-token latency histograms, one per mode, drawn on one shared millisecond axis.

Each mode gets a band of vertical bars (bins left to right, one character per bin); all bands use
the same bin edges (`fgchat.metrics.shared_bins`), so a faster mode's mass sits visibly further
left. Heights scale to each mode's own peak (shapes compare; counts are printed as n=).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from fgchat.engine.events import MODES
from fgchat.metrics import histogram, shared_bins

MODE_STYLES: dict[str, str] = {"eager": "$error", "piecewise": "$warning", "full": "$success"}
_V_BLOCKS = "▁▂▃▄▅▆▇█"
LABEL_WIDTH = 11
_SHORT = {"eager": "eager", "piecewise": "piece", "full": "full"}


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
        self.counts: dict[str, np.ndarray] = {}  # last drawn counts per mode (tests, export)
        self.edges: np.ndarray | None = None

    def set_data(
        self, series: Mapping[str, np.ndarray], unavailable: Mapping[str, str], current_mode: str
    ) -> None:
        self.series = {m: np.asarray(series.get(m, np.empty(0)), dtype=np.float64) for m in MODES}
        self.unavailable = dict(unavailable)
        self.current_mode = current_mode
        self.refresh(layout=True)

    @property
    def total(self) -> int:
        return int(sum(len(v) for v in self.series.values()))

    def render(self) -> Content:
        width = max(self.size.width, LABEL_WIDTH + 8)
        bins = max(4, width - LABEL_WIDTH)
        rows = max(1, self.rows_per_mode)
        populated = {m: v for m, v in self.series.items() if v.size}
        edges = shared_bins(populated, bins) if populated else None
        self.edges = edges
        lines: list[Content] = []
        for mode in MODES:
            values = self.series[mode]
            style = MODE_STYLES[mode]
            marker = "▶" if mode == self.current_mode else " "
            labels = [f"{marker}{mode}"[:LABEL_WIDTH], f" n={compact_count(values.size)}"]
            if edges is not None and values.size:
                counts = histogram(values, edges)
                self.counts[mode] = counts
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
                lines.append(
                    Content.assemble(
                        (label[:LABEL_WIDTH].ljust(LABEL_WIDTH), label_style), (bar, dim or style)
                    )
                )
        lines.append(self._axis(edges, bins))
        return Content("\n").join(lines)

    def _axis(self, edges: np.ndarray | None, bins: int) -> Content:
        if edges is None:
            return Content.assemble(("ITL ms".ljust(LABEL_WIDTH), "$text-muted"), ("─" * bins, "$text-muted"))
        lo, hi = fmt_ms(float(edges[0])), fmt_ms(float(edges[-1]))
        mid = fmt_ms(float(edges[len(edges) // 2]))
        fill = bins - len(lo) - len(hi)
        if fill >= len(mid) + 4:
            left = (fill - len(mid)) // 2
            axis = lo + "─" * left + mid + "─" * (fill - len(mid) - left) + hi
        else:
            axis = lo + "─" * max(fill, 1) + hi
        return Content.assemble(("ITL ms".ljust(LABEL_WIDTH), "$text-muted"), (axis[:bins], "$text-muted"))
