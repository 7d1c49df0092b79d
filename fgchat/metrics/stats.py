"""Latency statistics (numpy). Conventions follow LLM serving benchmarks:

- TTFT: time to first token of a request (from request records; token events carry no submit time).
- TPOT: per request, (e2e - ttft) / (output_tokens - 1): excludes the first token; requests with
  fewer than two output tokens have no TPOT.
- ITL: every non-first token's inter-token latency.
Percentiles use numpy's default (linear interpolation between closest ranks).
None and non-finite values are dropped before any statistic; empty input gives None fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fgchat.metrics.records import LatencyLog, RequestRecord, TokenRecord

STAT_NAMES: tuple[str, ...] = ("mean", "p50", "p90", "p99")
# A step whose host launch time reaches this fraction of its GPU time is treated as host-bound:
# its latency then follows the host CPU (H200, 1B piecewise at 0.77 measured 1.02-1.76 ms).
HOST_BOUND_FRACTION = 0.75


def host_bound(launch_ms: float | None, gpu_ms: float | None) -> bool:
    """Enqueueing a step takes nearly as long as the GPU runs it (False when either is unknown)."""
    return launch_ms is not None and gpu_ms is not None and gpu_ms > 0 and launch_ms >= HOST_BOUND_FRACTION * gpu_ms


def bandwidth_share(step_bytes: int, step_ms: float | None, peak_bytes_per_s: float | None) -> float | None:
    """The share of the GPU's peak memory bandwidth a step reached that reads `step_bytes` in
    `step_ms` (its weights: a decode step at batch 1..8 reads each once); None when unknown."""
    if not step_bytes or not step_ms or step_ms <= 0 or not peak_bytes_per_s:
        return None
    return step_bytes / (step_ms * 1e-3) / peak_bytes_per_s


@dataclass(frozen=True)
class Stats:
    """mean / p50 / p90 / p99 of the finite values; all None when count == 0."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    count: int


def clean(values: Iterable[float | None]) -> np.ndarray:
    """Float64 array of the finite values (None, NaN and ±inf dropped). A float array is
    converted in numpy (it holds no None), anything else value by value."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "f":
        arr = values.astype(np.float64, copy=False).reshape(-1)
    else:
        arr = np.asarray([v for v in values if v is not None], dtype=np.float64).reshape(-1)
    return arr[np.isfinite(arr)]


def summarize(values: Iterable[float | None]) -> Stats:
    """Stats of the finite values in `values`; safe on None entries and on empty input."""
    return finite_stats(clean(values))


def finite_stats(arr: np.ndarray) -> Stats:
    """Stats of a float64 array that holds only finite values (as `clean` returns)."""
    if arr.size == 0:
        return Stats(None, None, None, None, 0)
    p50, p90, p99 = np.percentile(arr, [50.0, 90.0, 99.0])
    return Stats(float(arr.mean()), float(p50), float(p90), float(p99), int(arr.size))


def request_tpot_ms(record: RequestRecord) -> float | None:
    """(e2e - ttft) / (output_tokens - 1); None with fewer than two output tokens."""
    if record.output_tokens < 2:
        return None
    value = (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)
    return value if math.isfinite(value) else None


def itl_by_mode(
    log_or_tokens: LatencyLog | Sequence[TokenRecord], modes: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """ITL values (non-first tokens) grouped by mode — the input `shared_bins` wants.

    With `modes`, every listed mode gets a key (possibly an empty array), in that order.
    """
    tokens = log_or_tokens.tokens() if isinstance(log_or_tokens, LatencyLog) else log_or_tokens
    grouped: dict[str, list[float | None]] = {m: [] for m in (modes or ())}
    for t in tokens:
        if not t.is_first_token and (modes is None or t.mode in grouped):
            grouped.setdefault(t.mode, []).append(t.itl_ms)
    return {m: clean(v) for m, v in grouped.items()}


def latency_summary(
    log: LatencyLog, mode: str | None = None, batch_size: int | None = None
) -> dict[str, Any]:
    """Summary of everything in `log`; see `summarize_records` for filters and keys."""
    tokens, requests = log.snapshot()
    return summarize_records(tokens, requests, mode=mode, batch_size=batch_size)


def summarize_records(
    tokens: Sequence[TokenRecord],
    requests: Sequence[RequestRecord],
    mode: str | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Flat dict of latency figures; every key carries its unit.

    Keys (X in ttft, tpot, itl; S in mean, p50, p90, p99):
      f"{X}_ms_{S}" (float | None), f"{X}_count" (int),
      mode, batch_size (the filters), tokens (token records that pass the filters),
      tokens_per_s: per-sequence decode speed, 1000 / itl_ms_mean,
      throughput_tokens_per_s: all sequences together, decode tokens / sum(itl_ms / batch_size)
        (a step of batch b yields b tokens, so each token owns 1/b of its step's time),
      gpu_step_ms_mean: mean GPU time of the steps behind non-first tokens,
      host_overhead_ms_mean: mean of (itl_ms - gpu_step_ms) over non-first tokens having both,
      gpu_fraction: gpu_step_ms_mean / itl_ms_mean over those same tokens,
      launch_ms_mean: mean host time to enqueue the steps behind non-first tokens (a mode is
        host-bound when it reaches gpu_step_ms_mean).

    Filters:
      mode: tokens produced in that mode. ITL/GPU/host use those tokens. TTFT counts requests
        whose *first* token was produced in `mode` (prefill usually reports "eager", so TTFT for
        "full" is typically empty — honest, since graphs do not run prefill). TPOT counts requests
        whose every non-first token ran in `mode` (mixed requests only count when mode is None).
      batch_size: tokens produced at that batch size; TTFT/TPOT then count requests whose tokens
        all ran at that batch size.
    """
    selected = [
        t
        for t in tokens
        if (mode is None or t.mode == mode) and (batch_size is None or t.batch_size == batch_size)
    ]
    ttft_values, tpot_values = _request_values(tokens, requests, mode, batch_size)
    decode = [t for t in selected if not t.is_first_token and t.itl_ms is not None]
    out: dict[str, Any] = {"mode": mode, "batch_size": batch_size, "tokens": len(selected)}
    out.update(summary_figures(
        ttft=clean(ttft_values),
        tpot=clean(tpot_values),
        itl=floats(t.itl_ms for t in decode),
        gpu=floats(t.gpu_step_ms for t in decode),
        launch=floats(t.launch_ms for t in decode),
        batch=np.asarray([t.batch_size for t in decode], dtype=np.int64),
    ))
    return out


def floats(values: Iterable[float | None]) -> np.ndarray:
    """Float64 array of `values` in order, None as NaN (positions kept, unlike `clean`)."""
    return np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)


def summary_figures(
    *,
    ttft: np.ndarray,
    tpot: np.ndarray,
    itl: np.ndarray,
    gpu: np.ndarray,
    launch: np.ndarray,
    batch: np.ndarray,
) -> dict[str, Any]:
    """`summarize_records`' figures besides mode, batch_size and tokens.

    ttft, tpot: the requests' values, finite only. itl, gpu, launch, batch: one entry per decode
    token (non-first, ITL not None) in arrival order, a missing value as NaN; non-finite entries
    are left out of each figure that uses them.
    """
    out: dict[str, Any] = {}
    finite_itl = np.isfinite(itl)
    itl_values = itl[finite_itl]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl_values)):
        stats = finite_stats(values)
        for stat in STAT_NAMES:
            out[f"{name}_ms_{stat}"] = getattr(stats, stat)
        out[f"{name}_count"] = stats.count

    itl_mean = out["itl_ms_mean"]
    out["tokens_per_s"] = 1000.0 / itl_mean if itl_mean else None
    # each token owns itl/batch of wall time: a step of batch b emits b tokens at once
    # (summed by Python's sum in arrival order: the same inputs give the same float everywhere)
    owned_ms = float(sum((itl_values / np.maximum(batch[finite_itl], 1)).tolist()))
    out["throughput_tokens_per_s"] = itl_values.size * 1000.0 / owned_ms if owned_ms > 0 else None
    gpu_values = gpu[np.isfinite(gpu)]
    out["gpu_step_ms_mean"] = float(gpu_values.mean()) if gpu_values.size else None
    launch_values = launch[np.isfinite(launch)]
    out["launch_ms_mean"] = float(launch_values.mean()) if launch_values.size else None
    both = finite_itl & np.isfinite(gpu)
    if both.any():
        pairs = np.empty((int(both.sum()), 2), dtype=np.float64)
        pairs[:, 0], pairs[:, 1] = itl[both], gpu[both]
        out["host_overhead_ms_mean"] = float((pairs[:, 0] - pairs[:, 1]).mean())
        itl_sum = float(pairs[:, 0].sum())
        out["gpu_fraction"] = float(pairs[:, 1].sum()) / itl_sum if itl_sum > 0 else None
    else:
        out["host_overhead_ms_mean"] = None
        out["gpu_fraction"] = None
    return out


def _request_values(
    tokens: Sequence[TokenRecord],
    requests: Sequence[RequestRecord],
    mode: str | None,
    batch_size: int | None,
) -> tuple[list[float], list[float]]:
    """TTFT and TPOT values of the requests that pass the filters (see summarize_records)."""
    if mode is None and batch_size is None:
        ttft = [r.ttft_ms for r in requests]
        tpot = [v for r in requests if (v := request_tpot_ms(r)) is not None]
        return ttft, tpot

    first_mode: dict[int, str] = {}
    decode_modes: dict[int, set[str]] = {}
    batches: dict[int, set[int]] = {}
    for t in tokens:
        if t.is_first_token:
            first_mode[t.request_id] = t.mode
        else:
            decode_modes.setdefault(t.request_id, set()).add(t.mode)
        batches.setdefault(t.request_id, set()).add(t.batch_size)

    ttft: list[float] = []
    tpot: list[float] = []
    for r in requests:
        rid = r.request_id
        if batch_size is not None and batches.get(rid) != {batch_size}:
            continue
        if mode is None or first_mode.get(rid) == mode:
            ttft.append(r.ttft_ms)
        if mode is None or decode_modes.get(rid) == {mode}:
            value = request_tpot_ms(r)
            if value is not None:
                tpot.append(value)
    return ttft, tpot
