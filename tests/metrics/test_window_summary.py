"""WindowSummary (the latency console's stats table) against a plain, record-by-record reference."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import fgchat.metrics.window_summary as window_summary
from fgchat.metrics import LatencyLog, WindowSummary, summarize_records
from fgchat.protocol.events import MODES, RequestSummary, TokenEvent

pytest.importorskip("textual")  # the GPU machine has no textual unless its wheels are carried
from fgchat.tui.latency_console import (  # noqa: E402
    STATS_WINDOW_REQUESTS,
    STATS_WINDOW_TOKENS,
    LatencyConsole,
    PanelStatus,
)


def _finite(values) -> np.ndarray:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64).reshape(-1)
    return arr[np.isfinite(arr)]


def _stats(values) -> dict:
    arr = _finite(values)
    if arr.size == 0:
        return dict(mean=None, p50=None, p90=None, p99=None, count=0)
    p50, p90, p99 = np.percentile(arr, [50.0, 90.0, 99.0])
    return dict(mean=float(arr.mean()), p50=float(p50), p90=float(p90), p99=float(p99), count=int(arr.size))


def _tpot(r) -> float | None:
    if r.output_tokens < 2:
        return None
    value = (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1)
    return value if math.isfinite(value) else None


def reference(tokens, requests, mode=None, batch_size=None) -> dict:
    """The figures computed one record at a time, straight from summarize_records' definitions."""
    selected = [t for t in tokens
                if (mode is None or t.mode == mode) and (batch_size is None or t.batch_size == batch_size)]
    by_request = {}
    for t in tokens:
        by_request.setdefault(t.request_id, []).append(t)
    ttft, tpot = [], []
    for r in requests:
        own = by_request.get(r.request_id, [])
        if batch_size is not None and {t.batch_size for t in own} != {batch_size}:
            continue
        if mode is None or any(t.is_first_token and t.mode == mode for t in own):
            ttft.append(r.ttft_ms)
        if mode is None or {t.mode for t in own if not t.is_first_token} == {mode}:
            tpot.append(_tpot(r))
    decode = [t for t in selected if not t.is_first_token and t.itl_ms is not None]
    itl = _finite(t.itl_ms for t in decode)
    out = {"mode": mode, "batch_size": batch_size, "tokens": len(selected)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        stats = _stats(values)
        for stat in ("mean", "p50", "p90", "p99"):
            out[f"{name}_ms_{stat}"] = stats[stat]
        out[f"{name}_count"] = stats["count"]
    out["tokens_per_s"] = 1000.0 / out["itl_ms_mean"] if out["itl_ms_mean"] else None
    owned = float(sum(t.itl_ms / max(t.batch_size, 1) for t in decode if math.isfinite(t.itl_ms)))
    out["throughput_tokens_per_s"] = len(itl) * 1000.0 / owned if owned > 0 else None
    gpu = _finite(t.gpu_step_ms for t in decode)
    out["gpu_step_ms_mean"] = float(gpu.mean()) if gpu.size else None
    launch = _finite(t.launch_ms for t in decode)
    out["launch_ms_mean"] = float(launch.mean()) if launch.size else None
    pairs = np.asarray([(t.itl_ms, t.gpu_step_ms) for t in decode if t.gpu_step_ms is not None
                        and math.isfinite(t.itl_ms) and math.isfinite(t.gpu_step_ms)],
                       dtype=np.float64).reshape(-1, 2)
    itl_sum = float(pairs[:, 0].sum())
    out.update(
        host_overhead_ms_mean=float((pairs[:, 0] - pairs[:, 1]).mean()) if len(pairs) else None,
        gpu_fraction=float(pairs[:, 1].sum()) / itl_sum if len(pairs) and itl_sum > 0 else None,
    )
    return out


class RandomStream:
    """Requests of 1-9 tokens at random modes and batch sizes (a few tokens switch mode or batch),
    random ITLs with some NaN/inf, GPU and launch times sometimes missing, a few TTFTs NaN; each
    request's record is added after its last token."""

    def __init__(self, log: LatencyLog, seed: int) -> None:
        self.log, self.rng = log, random.Random(seed)
        self.rid, self.left, self.index, self.t_ns = 0, 0, 0, 0
        self.mode, self.batch = MODES[0], 1

    def add(self, n: int) -> None:
        rng = self.rng
        for _ in range(n):
            if self.left == 0:
                self._start()
            first = self.index == 0
            mode = rng.choice(MODES) if rng.random() < 0.1 else self.mode
            batch = rng.randint(1, 8) if rng.random() < 0.1 else self.batch
            itl = None if first else rng.choice([rng.expovariate(1 / 3), rng.uniform(0.5, 40.0)])
            if itl is not None and rng.random() < 0.01:
                itl = rng.choice([math.nan, math.inf])
            self.t_ns += 3_000_000
            self.log.add_token(TokenEvent(
                request_id=self.rid, token_index=self.index, token_id=7, text="x", mode=mode,
                batch_size=batch, t_ns=self.t_ns, itl_ms=itl,
                gpu_step_ms=None if rng.random() < 0.2 else rng.uniform(0.1, 5.0),
                is_first_token=first, position=10 + self.index,
                launch_ms=None if first or rng.random() < 0.3 else rng.uniform(0.01, 2.0),
            ), chat_id="c")
            self.index += 1
            self.left -= 1
            if self.left == 0:
                self._finish()

    def finish_alone(self) -> None:
        """A request record arrives with no token since the last call (a cancelled request)."""
        if self.left:
            self.left = 0
            self._finish()

    def _start(self) -> None:
        self.rid += 1
        self.left, self.index = self.rng.randint(1, 9), 0
        self.mode, self.batch = self.rng.choice(MODES), self.rng.choice([1, 2, 4, 8])

    def _finish(self) -> None:
        rng = self.rng
        ttft = math.nan if rng.random() < 0.01 else rng.uniform(1.0, 50.0)
        e2e = math.inf if rng.random() < 0.02 else ttft + rng.uniform(0.0, 300.0)
        self.log.add_request(RequestSummary(
            request_id=self.rid, prompt_tokens=10, output_tokens=self.index, ttft_ms=ttft,
            tpot_ms=None, e2e_ms=e2e, finish_reason="length", text="",
        ), chat_id="c")


def _windows(log: LatencyLog, tokens: int, requests: int) -> dict:
    return reference(log.tokens()[-tokens:], log.requests()[-requests:])


@pytest.mark.parametrize("windows", [(STATS_WINDOW_TOKENS, STATS_WINDOW_REQUESTS), (37, 5)])
def test_window_summary_equals_reference_as_log_grows(windows):
    log = LatencyLog(start_ns=0)
    stream, stats = RandomStream(log, seed=14), WindowSummary(log, *windows)
    assert stats.summary() == _windows(log, *windows)  # empty log
    # crosses the 5000-token and 1000-request windows, in small chunks and in one bigger than both
    for chunk in (3000, 1500, 1, 400, 99, 250, 7, 6000, 1):
        stream.add(chunk)
        expected = _windows(log, *windows)
        assert stats.summary() == expected
        assert stats.summary() == expected  # unchanged log
        assert stats.window_tokens == min(log.token_count, windows[0])
        stream.finish_alone()  # a request record without new tokens
        assert stats.summary() == _windows(log, *windows)
    assert log.token_count > STATS_WINDOW_TOKENS and log.request_count > STATS_WINDOW_REQUESTS


def test_summarize_records_matches_reference_with_filters():
    log = LatencyLog(start_ns=0)
    RandomStream(log, seed=3).add(4000)
    tokens, requests = log.snapshot()
    for mode in (None, *MODES):
        for batch_size in (None, 1, 4, 8):
            assert summarize_records(tokens, requests, mode, batch_size) == reference(
                tokens, requests, mode, batch_size)


def test_unchanged_log_is_not_summarized_again(monkeypatch):
    calls = []
    real = window_summary.summary_figures
    monkeypatch.setattr(window_summary, "summary_figures", lambda **kw: calls.append(1) or real(**kw))
    log = LatencyLog(start_ns=0)
    stream, stats = RandomStream(log, seed=5), WindowSummary(log, 100, 10)
    stream.add(500)
    first = stats.summary()
    first["tokens"] = -1  # callers get their own dict
    assert stats.summary()["tokens"] == 100 and len(calls) == 1
    stream.add(1)
    stats.summary()
    assert len(calls) == 2


def test_console_shows_the_window_summary():
    console = LatencyConsole()
    stream = RandomStream(console.log, seed=9)
    stream.add(2000)
    view = console.build(PanelStatus())
    assert view.summary == _windows(console.log, STATS_WINDOW_TOKENS, STATS_WINDOW_REQUESTS)
    assert (view.windowed, view.total_tokens) == (0, 2000)
    stream.add(3500)
    view = console.build(PanelStatus())
    assert view.summary == _windows(console.log, STATS_WINDOW_TOKENS, STATS_WINDOW_REQUESTS)
    assert (view.windowed, view.total_tokens) == (STATS_WINDOW_TOKENS, 5500)

