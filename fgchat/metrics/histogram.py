"""Histograms on one shared axis, and tiny text renderers (block characters, no UI imports).

Invariants:
- `shared_bins` returns n_bins + 1 strictly increasing, finite edges, whatever the input
  (empty series, one value, NaN, outliers).
- `histogram` folds values outside the edges into the first / last bin, so its counts always sum
  to the number of finite values given: nothing silently disappears off the chart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fgchat.metrics.stats import clean

# eighths of a cell, left to right; index k draws k/8 of a character cell
_H_BLOCKS = " ▏▎▍▌▋▊▉█"
# eight heights, bottom to top
_V_BLOCKS = "▁▂▃▄▅▆▇█"


def shared_bins(
    series: Mapping[str, Iterable[float | None]],
    n_bins: int,
    clip_percentile: float = 99.5,
) -> np.ndarray:
    """One common set of bin edges for all series, so modes compare at a glance.

    Low edge: the smallest finite value of any series. High edge: the largest of the series'
    own `clip_percentile` percentiles — taken per series so a slow mode with few samples is
    never clipped away by a fast mode with many; rarer outliers land in the last bin.
    Empty input gives edges over [0, 1].
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if not 0.0 < clip_percentile <= 100.0:
        raise ValueError(f"clip_percentile must be in (0, 100], got {clip_percentile}")
    lows: list[float] = []
    highs: list[float] = []
    for values in series.values():
        arr = clean(values)
        if arr.size:
            lows.append(float(arr.min()))
            highs.append(float(np.percentile(arr, clip_percentile)))
    if not lows:
        return np.linspace(0.0, 1.0, n_bins + 1)
    lo, hi = min(lows), max(highs)
    if not hi > lo:  # a single distinct value: give it a visible width around itself
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, lo + pad
    edges = np.linspace(lo, hi, n_bins + 1)
    if not np.all(np.diff(edges) > 0):  # float resolution exhausted (huge magnitude, tiny span)
        edges = lo + np.arange(n_bins + 1, dtype=np.float64) * max(abs(lo), 1.0) * 1e-9
    return edges


def histogram(values: Iterable[float | None], edges: Sequence[float] | np.ndarray) -> np.ndarray:
    """Counts per bin (int64, len(edges) - 1); out-of-range values go to the end bins."""
    edges_arr = np.asarray(edges, dtype=np.float64)
    if edges_arr.ndim != 1 or edges_arr.size < 2:
        raise ValueError("edges must be a 1-D sequence of at least two values")
    arr = np.clip(clean(values), edges_arr[0], edges_arr[-1])
    counts, _ = np.histogram(arr, bins=edges_arr)
    return counts.astype(np.int64)


def render_bars(
    counts: Sequence[int] | np.ndarray, width: int, max_count: int | None = None
) -> list[str]:
    """One horizontal bar per bin, each line exactly `width` characters (space padded).

    Bars scale to `max_count` (default: the largest count); pass the largest count over several
    histograms to draw them on one scale. A non-zero count always shows at least 1/8 cell.
    """
    width = max(int(width), 0)
    counts_arr = np.asarray(counts, dtype=np.float64).reshape(-1)
    scale = float(max_count) if max_count is not None else float(counts_arr.max(initial=0.0))
    lines: list[str] = []
    for c in counts_arr:
        eighths = 0
        if c > 0 and scale > 0 and width > 0:
            eighths = min(width * 8, max(1, int(round(c / scale * width * 8))))
        full, part = divmod(eighths, 8)
        bar = "█" * full + (_H_BLOCKS[part] if part else "")
        lines.append(bar.ljust(width))
    return lines


def sparkline(
    values: Sequence[float | None],
    width: int,
    lo: float | None = None,
    hi: float | None = None,
) -> str:
    """The last `width` values as one character each (▁..█); None/NaN draw as a space.

    Scaled to [lo, hi] (default: min/max of the shown finite values); a flat line draws as ▄.
    """
    width = max(int(width), 0)
    shown = list(values)[-width:] if width else []
    finite = clean(shown)
    if not shown:
        return ""
    low = float(lo) if lo is not None else (float(finite.min()) if finite.size else 0.0)
    high = float(hi) if hi is not None else (float(finite.max()) if finite.size else low)
    span = high - low
    chars: list[str] = []
    for v in shown:
        if v is None or not np.isfinite(v):
            chars.append(" ")
        elif span <= 0:
            chars.append(_V_BLOCKS[3])
        else:
            frac = min(max((float(v) - low) / span, 0.0), 1.0)
            chars.append(_V_BLOCKS[int(round(frac * (len(_V_BLOCKS) - 1)))])
    return "".join(chars)
