"""fgchat.metrics: records, statistics, histograms, CSV export."""

from __future__ import annotations

import csv
import math
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import RequestSummary, TokenEvent
from fgchat.metrics import (
    REQUEST_COLUMNS,
    TOKEN_COLUMNS,
    CsvAppender,
    LatencyLog,
    histogram,
    itl_by_mode,
    latency_summary,
    read_requests_csv,
    read_tokens_csv,
    render_bars,
    shared_bins,
    sparkline,
    summarize,
    write_requests_csv,
    write_tokens_csv,
)

START_NS = 1_000_000_000


def ev(
    rid: int,
    idx: int,
    t_ms: float,
    itl: float | None = None,
    mode: str = "full",
    batch: int = 1,
    gpu: float | None = None,
    prompt: int = 16,
    first: bool | None = None,
    launch: float | None = None,
) -> TokenEvent:
    is_first = idx == 0 if first is None else first
    return TokenEvent(
        request_id=rid,
        token_index=idx,
        token_id=100 + idx,
        text="x",
        mode=mode,  # type: ignore[arg-type]
        batch_size=batch,
        t_ns=START_NS + round(t_ms * 1e6),
        itl_ms=itl,
        gpu_step_ms=gpu,
        is_first_token=is_first,
        position=prompt + idx,
        launch_ms=launch,
    )


def summary(
    rid: int, n: int, ttft: float, e2e: float, reason: str = "stop", modes: dict | None = None
) -> RequestSummary:
    return RequestSummary(
        request_id=rid,
        prompt_tokens=16,
        output_tokens=n,
        ttft_ms=ttft,
        tpot_ms=(e2e - ttft) / (n - 1) if n > 1 else None,
        e2e_ms=e2e,
        finish_reason=reason,  # type: ignore[arg-type]
        text="",
        mode_counts=modes or {},
    )


def add_request(log: LatencyLog, rid: int, itls: list[float], ttft: float, **kw) -> None:
    """Tokens of one request: first token at ttft, then one per itl; then its summary."""
    t = ttft
    first_mode = kw.pop("first_mode", "eager")
    log.add_token(ev(rid, 0, t, None, mode=first_mode, **{k: v for k, v in kw.items() if k != "mode"}), "c1")
    for i, itl in enumerate(itls, start=1):
        t += itl
        log.add_token(ev(rid, i, t, itl, **kw), "c1")
    log.add_request(summary(rid, len(itls) + 1, ttft, t), "c1")


# --- summarize -----------------------------------------------------------------------------


def test_percentiles_match_hand_computed_values():
    s = summarize([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    # linear interpolation: rank = q * (n - 1); p90 -> 8.1 -> 9 + 0.1; p99 -> 8.91 -> 9 + 0.91
    assert s.count == 10
    assert s.mean == pytest.approx(5.5)
    assert s.p50 == pytest.approx(5.5)
    assert s.p90 == pytest.approx(9.1)
    assert s.p99 == pytest.approx(9.91)

    s = summarize([40.0, 10.0, 30.0, 20.0])  # unsorted on purpose
    assert (s.p50, s.p90, s.p99) == pytest.approx((25.0, 37.0, 39.7))
    assert s.mean == pytest.approx(25.0)


def test_summarize_is_none_and_empty_safe():
    s = summarize([None, 3.0, float("nan"), 1.0, 2.0, float("inf")])
    assert s.count == 3
    assert (s.mean, s.p50) == pytest.approx((2.0, 2.0))
    for empty in ([], [None, None], [float("nan")]):
        s = summarize(empty)
        assert s.count == 0
        assert s.mean is None and s.p50 is None and s.p90 is None and s.p99 is None
    one = summarize([7.0])
    assert (one.mean, one.p50, one.p90, one.p99, one.count) == (7.0, 7.0, 7.0, 7.0, 1)


# --- records -------------------------------------------------------------------------------


def test_token_record_fields_and_relative_time():
    log = LatencyLog(start_ns=START_NS)
    r = log.add_token(ev(3, 0, 2.5, None, mode="eager", batch=2, prompt=10), "chat-a")
    assert r.t_ms == pytest.approx(2.5)
    assert r.prompt_tokens == 10 and r.position == 10 and r.is_first_token
    r2 = log.add_token(ev(3, 1, 4.0, 1.5, batch=3, gpu=1.25, prompt=10), "chat-a", prompt_tokens=10)
    assert (r2.itl_ms, r2.gpu_step_ms, r2.mode, r2.batch_size) == (1.5, 1.25, "full", 3)
    assert [f for f in r2.__dataclass_fields__] == list(TOKEN_COLUMNS)

    req = log.add_request(summary(3, 2, 2.5, 4.0), "chat-a")
    assert req.batch_size_max == 3
    assert req.modes == {"eager": 1, "full": 1}  # from tokens: summary.mode_counts was empty
    assert [f for f in req.__dataclass_fields__] == list(REQUEST_COLUMNS)
    # summary.mode_counts wins when given; unknown request has no batch size
    req2 = log.add_request(summary(9, 1, 5.0, 5.0, modes={"full": 4, "eager": 1}), "chat-b")
    assert list(req2.modes.items()) == [("eager", 1), ("full", 4)]
    assert req2.batch_size_max is None
    assert len(log) == 2 and log.request_count == 2
    assert log.tokens_since(1) == [r2]


def test_log_is_thread_safe():
    log = LatencyLog(start_ns=START_NS)

    def worker(rid: int) -> None:
        for i in range(500):
            log.add_token(ev(rid, i, float(i), None if i == 0 else 1.0), f"c{rid}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(log) == 4000
    for rid in range(8):
        idx = [t.token_index for t in log.tokens() if t.request_id == rid]
        assert idx == list(range(500))  # per-request arrival order preserved


# --- latency_summary ------------------------------------------------------------------------


def test_tpot_excludes_first_token_and_itl_excludes_first():
    log = LatencyLog(start_ns=START_NS)
    # TTFT 100 ms, then 9 tokens 10 ms apart: e2e 190, TPOT = 90 / 9 = 10 (not 190 / 10 = 19)
    add_request(log, 1, [10.0] * 9, ttft=100.0)
    # a first token that (wrongly) carries an itl must still not count as ITL
    log.add_token(ev(2, 0, 300.0, 999.0, first=True), "c1")
    # single-token request: has TTFT, no TPOT
    log.add_token(ev(3, 0, 50.0, None), "c1")
    log.add_request(summary(3, 1, 50.0, 50.0), "c1")

    s = latency_summary(log)
    assert s["tpot_count"] == 1
    assert s["tpot_ms_mean"] == pytest.approx(10.0)
    assert s["itl_count"] == 9
    assert s["itl_ms_p99"] == pytest.approx(10.0)
    assert s["ttft_count"] == 2
    assert s["ttft_ms_mean"] == pytest.approx(75.0)
    assert s["tokens_per_s"] == pytest.approx(100.0)
    for key in s:
        if key.startswith(("ttft", "tpot", "itl")):
            assert key.endswith("_count") or "_ms_" in key  # units in the name


def test_summary_mode_filter_batch_throughput_and_host_overhead():
    log = LatencyLog(start_ns=START_NS)
    add_request(log, 1, [2.0, 2.0, 2.0], ttft=20.0, mode="full", gpu=1.5)  # pure full
    add_request(log, 2, [8.0, 8.0], ttft=30.0, mode="eager", gpu=2.0)  # pure eager
    # mixed request: counts for ITL per mode, but its TPOT only counts unfiltered
    log.add_token(ev(3, 0, 0.0, None, mode="eager"), "c1")
    log.add_token(ev(3, 1, 2.0, 2.0, mode="full", gpu=1.5, launch=0.25), "c1")
    log.add_token(ev(3, 2, 10.0, 8.0, mode="eager", gpu=2.0, launch=6.5), "c1")
    log.add_request(summary(3, 3, 0.0, 10.0), "c1")

    full = latency_summary(log, mode="full")
    assert full["itl_count"] == 4 and full["itl_ms_mean"] == pytest.approx(2.0)
    assert full["tpot_count"] == 1 and full["tpot_ms_mean"] == pytest.approx(2.0)
    assert full["ttft_count"] == 0 and full["ttft_ms_p50"] is None  # prefill ran eager
    assert full["gpu_step_ms_mean"] == pytest.approx(1.5)
    assert full["host_overhead_ms_mean"] == pytest.approx(0.5)
    assert full["gpu_fraction"] == pytest.approx(0.75)
    assert full["launch_ms_mean"] == pytest.approx(0.25)  # only tokens that carry a launch time

    eager = latency_summary(log, mode="eager")
    assert eager["itl_count"] == 3 and eager["itl_ms_mean"] == pytest.approx(8.0)
    assert eager["ttft_count"] == 3
    assert eager["host_overhead_ms_mean"] == pytest.approx(6.0)
    assert eager["launch_ms_mean"] == pytest.approx(6.5)

    everything = latency_summary(log)
    assert everything["tpot_count"] == 3 and everything["itl_count"] == 7
    assert latency_summary(log, mode="piecewise")["itl_ms_mean"] is None

    # batch 2: each token owns half its step; 4 tokens * 10 ms / 2 = 20 ms -> 200 tok/s aggregate
    b = LatencyLog(start_ns=START_NS)
    add_request(b, 1, [10.0, 10.0], ttft=5.0, batch=2)
    add_request(b, 2, [10.0, 10.0], ttft=5.0, batch=2)
    s = latency_summary(b, batch_size=2)
    assert s["tokens_per_s"] == pytest.approx(100.0)
    assert s["throughput_tokens_per_s"] == pytest.approx(200.0)
    assert s["tpot_count"] == 2 and s["gpu_step_ms_mean"] is None and s["launch_ms_mean"] is None
    assert latency_summary(b, batch_size=1)["tokens"] == 0


def test_summary_of_empty_log():
    s = latency_summary(LatencyLog())
    assert s["tokens"] == 0 and s["itl_count"] == 0
    assert s["ttft_ms_mean"] is None and s["tokens_per_s"] is None
    assert s["throughput_tokens_per_s"] is None and s["host_overhead_ms_mean"] is None


# --- histograms -----------------------------------------------------------------------------


def test_shared_bins_cover_all_series_and_counts_sum_to_len():
    rng = np.random.default_rng(0)
    fast = rng.normal(2.0, 0.1, 10_000)
    fast[:5] = 500.0  # rare outliers must not stretch the axis
    slow = rng.normal(14.0, 0.5, 50)  # few samples: must not be clipped away by the fast mode
    series = {"full": fast, "eager": slow, "piecewise": []}
    edges = shared_bins(series, 40)
    assert len(edges) == 41 and np.all(np.diff(edges) > 0)
    for values in (fast, slow):
        assert edges[0] <= values.min()
        assert edges[-1] >= np.percentile(values, 99.5)
    assert edges[-1] < 100.0  # outliers clipped
    for values in (fast, slow):
        counts = histogram(values, edges)
        assert counts.shape == (40,) and counts.sum() == len(values)
    assert histogram(fast, edges)[-1] >= 5  # outliers folded into the last bin
    assert histogram([], edges).sum() == 0


def test_shared_bins_degenerate_inputs():
    for series in ({}, {"a": []}, {"a": [None, float("nan")]}):
        edges = shared_bins(series, 5)
        assert len(edges) == 6 and np.all(np.diff(edges) > 0)
    edges = shared_bins({"a": [3.0, 3.0, 3.0]}, 4)
    assert np.all(np.diff(edges) > 0) and edges[0] < 3.0 < edges[-1]
    assert histogram([3.0, 3.0, 3.0], edges).sum() == 3
    with pytest.raises(ValueError):
        shared_bins({"a": [1.0]}, 0)


def test_histogram_counts_and_out_of_range():
    counts = histogram([0.5, 1.5, 1.6, 2.5, -10.0, 99.0, None, float("nan")], [0.0, 1.0, 2.0, 3.0])
    assert counts.tolist() == [2, 2, 2]  # -10 -> first bin, 99 -> last; None/NaN dropped


def test_itl_by_mode_groups_non_first_tokens():
    log = LatencyLog(start_ns=START_NS)
    add_request(log, 1, [2.0, 3.0], ttft=1.0, mode="full")
    grouped = itl_by_mode(log, modes=("eager", "piecewise", "full"))
    assert list(grouped) == ["eager", "piecewise", "full"]
    assert grouped["full"].tolist() == [2.0, 3.0] and grouped["eager"].size == 0


def test_render_bars_and_sparkline():
    assert render_bars([0, 4, 8], 4) == ["    ", "██  ", "████"]
    lines = render_bars([1, 1000], 3)
    assert lines[0] == "▏  " and lines[1] == "███"  # non-zero is always visible
    assert all(len(line) == 5 for line in render_bars([3, 0, 7, 2], 5))
    assert render_bars([2, 4], 4, max_count=8) == ["█   ", "██  "]  # common scale
    assert render_bars([0, 0], 3) == ["   ", "   "]

    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 2) == "▁█"  # last `width` values
    assert sparkline([1.0, None, 2.0], 10) == "▁ █"
    assert sparkline([], 5) == "" and sparkline([1.0], 0) == ""
    assert sparkline([5.0, 5.0], 4) == "▄▄"
    assert sparkline([0.0, 100.0], 4, lo=0.0, hi=200.0) == "▁▅"


# --- CSV ------------------------------------------------------------------------------------


def _filled_log() -> LatencyLog:
    log = LatencyLog(start_ns=START_NS)
    add_request(log, 1, [2.25, 2.5], ttft=12.5, mode="full", gpu=1.75, batch=2)
    log.add_token(ev(2, 0, 40.125, None, mode="eager", prompt=7), "chat,2")  # comma needs quoting
    log.add_request(summary(2, 1, 40.125, 40.125, reason="length"), "chat,2")
    return log


def test_tokens_csv_round_trip(tmp_path: Path):
    log = _filled_log()
    path = tmp_path / "tokens.csv"
    assert write_tokens_csv(path, log.tokens()) == 4
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == [
        "request_id", "chat_id", "token_index", "mode", "batch_size", "t_ms", "itl_ms",
        "gpu_step_ms", "is_first_token", "prompt_tokens", "position", "launch_ms", "endpoint",
        "step_id", "drafted", "draft_len", "accepted_in_step", "spec_method",
    ]
    assert len(rows) == len(log)
    assert rows[0] == {
        "request_id": "1", "chat_id": "c1", "token_index": "0", "mode": "eager",
        "batch_size": "2", "t_ms": "12.500", "itl_ms": "", "gpu_step_ms": "1.750",
        "is_first_token": "1", "prompt_tokens": "16", "position": "16", "launch_ms": "",
        "endpoint": "", "step_id": "-1", "drafted": "0", "draft_len": "0", "accepted_in_step": "0",
        "spec_method": "",
    }
    assert rows[2]["t_ms"] == "17.250" and rows[2]["itl_ms"] == "2.500"
    assert rows[2]["is_first_token"] == "0"
    assert rows[3]["chat_id"] == "chat,2" and rows[3]["gpu_step_ms"] == ""
    assert read_tokens_csv(path) == log.tokens()  # values chosen exact at 3 decimals
    assert not [p for p in tmp_path.iterdir() if p.name != "tokens.csv"]  # no temp left



def test_tokens_csv_keeps_launch_times_and_reads_files_written_before_that_column(tmp_path: Path):
    log = LatencyLog(start_ns=START_NS)
    log.add_token(ev(1, 0, 10.0), "c")
    log.add_token(ev(1, 1, 11.5, 1.5, gpu=1.25, launch=0.375), "c")
    path = tmp_path / "tokens.csv"
    write_tokens_csv(path, log.tokens())
    back = read_tokens_csv(path)
    assert [r.launch_ms for r in back] == [None, 0.375] and back == log.tokens()
    old = tmp_path / "old.csv"
    lines = path.read_text().splitlines()
    assert lines[0].endswith(",launch_ms,endpoint,step_id,drafted,draft_len,accepted_in_step,spec_method")
    old.write_text("\n".join(line.rsplit(",", 7)[0] for line in lines) + "\n")  # drop the added ones
    assert [r.launch_ms for r in read_tokens_csv(old)] == [None, None]
    assert [r.gpu_step_ms for r in read_tokens_csv(old)] == [None, 1.25]
    assert [r.endpoint for r in read_tokens_csv(old)] == ["", ""]


def test_endpoint_column_round_trips_and_old_log_csv_keeps_its_columns(tmp_path: Path):
    log = LatencyLog(start_ns=START_NS)
    url = "http://127.0.0.1:9/v1"
    log.add_token(ev(1, 0, 10.0), "c", endpoint=url)
    log.add_token(ev(1, 1, 11.5, 1.5), "c", endpoint=url)
    log.add_request(summary(1, 2, 10.0, 11.5), "c", endpoint=url)
    log.add_token(ev(2, 0, 20.0), "c")  # the local engine: empty cell
    tokens_csv, requests_csv = tmp_path / "t.csv", tmp_path / "r.csv"
    write_tokens_csv(tokens_csv, log.tokens(), session_id="s1")
    write_requests_csv(requests_csv, log.requests(), session_id="s1")
    assert [r.endpoint for r in read_tokens_csv(tokens_csv)] == [url, url, ""]
    assert read_tokens_csv(tokens_csv) == log.tokens()
    assert [r.endpoint for r in read_requests_csv(requests_csv)] == [url]
    with open(tokens_csv, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    at = rows[0].index("endpoint")
    assert rows[1][at] == url and rows[3][at] == ""
    # a --log-csv file written before the column: appended to in its own columns, one format
    old = tmp_path / "old.csv"
    old.write_text(",".join(["session_id", *TOKEN_COLUMNS[:-1]]) + "\n")
    with CsvAppender(old, session_id="s2") as appender:
        assert appender.sync(log) == 3
    with open(old, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert {len(r) for r in rows} == {len(TOKEN_COLUMNS)} and rows[1][0] == "s2"
    assert [r.token_index for r in read_tokens_csv(old)] == [0, 1, 0]


def test_recent_itl_is_a_window_of_the_log_per_mode():
    log = LatencyLog(start_ns=START_NS)
    add_request(log, 1, [1.0, 2.0, 3.0], ttft=5.0, mode="full")
    add_request(log, 2, [4.0, 5.0], ttft=9.0, mode="eager")
    log.add_token(ev(3, 1, 30.0, None, mode="eager"), "c1")  # no ITL: not in any window
    assert log.recent_itl(10, "full") == [1.0, 2.0, 3.0]
    assert log.recent_itl(2, "full") == [2.0, 3.0]
    assert log.recent_itl(10, "eager") == [4.0, 5.0]  # first tokens (prefill, eager) excluded
    assert log.recent_itl(3) == [3.0, 4.0, 5.0]
    assert log.recent_itl(0) == [] and log.recent_itl(5, "piecewise") == []
    # the same numbers as the records themselves
    assert log.recent_itl(100) == [t.itl_ms for t in log.tokens() if not t.is_first_token and t.itl_ms is not None]

def test_requests_csv_round_trip(tmp_path: Path):
    log = _filled_log()
    path = tmp_path / "requests.csv"
    assert write_requests_csv(path, log.requests()) == 2
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames or ()) == REQUEST_COLUMNS
    assert rows[0]["modes"] == "eager:1;full:2"
    assert rows[0]["tpot_ms"] == "2.375" and rows[0]["e2e_ms"] == "17.250"
    assert rows[0]["batch_size_max"] == "2"
    assert rows[1]["tpot_ms"] == "" and rows[1]["finish_reason"] == "length"
    assert read_requests_csv(path) == log.requests()


def test_atomic_write_fails_cleanly_on_unwritable_path(tmp_path: Path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("keep me")
    log = _filled_log()
    for bad in (blocker / "x.csv", tmp_path / "missing-dir" / "x.csv"):
        with pytest.raises(FgchatError) as info:
            write_tokens_csv(bad, log.tokens())
        message = str(info.value)
        assert "\n" not in message and str(bad) in message
    (tmp_path / "adir").mkdir()
    with pytest.raises(FgchatError):
        write_requests_csv(tmp_path / "adir", log.requests())  # target is a directory
    assert blocker.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "file.txt"]  # no partial file
    assert list((tmp_path / "adir").iterdir()) == []
    assert len(log) == 4 and log.request_count == 2  # in-memory log untouched


def test_atomic_write_keeps_old_file_when_replace_fails(tmp_path: Path, monkeypatch):
    path = tmp_path / "tokens.csv"
    path.write_text("old content\n")

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(FgchatError, match="No space left"):
        write_tokens_csv(path, _filled_log().tokens())
    assert path.read_text() == "old content\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tokens.csv"]


def test_written_file_is_not_private(tmp_path: Path):
    path = tmp_path / "t.csv"
    write_tokens_csv(path, [])
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would create, not mkstemp's 0600
    assert path.read_text().strip() == ",".join(TOKEN_COLUMNS)


def test_appender_writes_header_once(tmp_path: Path):
    log = _filled_log()
    path = tmp_path / "live.csv"
    tokens = log.tokens()
    with CsvAppender(path) as app:
        assert app.append(tokens[:2]) == 2
        assert app.append(tokens[2:]) == 2
        assert app.append([]) == 0
    with CsvAppender(path) as app:  # reopening an existing log: still one header
        app.append(tokens[:1])
    lines = path.read_text(encoding="utf-8").splitlines()
    assert sum(1 for line in lines if line.startswith("request_id,")) == 1
    assert len(lines) == 1 + 5
    with open(path, newline="", encoding="utf-8") as f:
        assert [r["token_index"] for r in csv.DictReader(f)] == ["0", "1", "2", "0", "0"]


def test_appender_sync_is_incremental_and_retries_after_error(tmp_path: Path):
    log = LatencyLog(start_ns=START_NS)
    path = tmp_path / "live.csv"
    app = CsvAppender(path)
    add_request(log, 1, [1.0, 1.0], ttft=3.0)
    assert app.sync(log) == 3
    assert app.sync(log) == 0

    class BrokenFile:
        closed = False

        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    real_file = app._file
    app._file = BrokenFile()  # type: ignore[assignment]
    add_request(log, 2, [1.0], ttft=9.0)
    with pytest.raises(FgchatError, match="No space left"):
        app.sync(log)
    assert len(log) == 5  # nothing lost in memory
    app._file = real_file
    assert app.sync(log) == 2  # the failed batch is written on the next sync
    app.close()
    assert len(read_tokens_csv(path)) == 5
    assert read_tokens_csv(path) == log.tokens()


def test_appender_rejects_bad_paths(tmp_path: Path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(FgchatError) as info:
        CsvAppender(blocker / "log.csv")
    assert "\n" not in str(info.value)
    other = tmp_path / "other.csv"
    other.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(FgchatError, match="header"):
        CsvAppender(other)
    assert other.read_text() == "a,b,c\n1,2,3\n"  # never appended to a foreign file
    if os.path.exists("/dev/full"):
        with pytest.raises(FgchatError):
            CsvAppender("/dev/full")


def test_appender_ends_a_cut_short_last_row(tmp_path: Path):
    path = tmp_path / "live.csv"
    path.write_text(",".join(TOKEN_COLUMNS) + "\n1,c1,0,eag")  # crash mid-row
    with CsvAppender(path) as app:
        app.append(_filled_log().tokens()[:1])
    lines = path.read_text().splitlines()
    assert lines[1] == "1,c1,0,eag" and lines[2].startswith("1,c1,0,eager,2,12.500,")
    assert math.isclose(float(lines[2].split(",")[5]), 12.5)


def test_host_bound_needs_both_times_and_compares_launch_with_gpu():
    from fgchat.metrics import HOST_BOUND_FRACTION, host_bound

    assert host_bound(HOST_BOUND_FRACTION * 2.0, 2.0) and host_bound(3.6, 3.7)
    assert not host_bound(0.007, 0.95) and not host_bound(0.7, 1.0)
    assert not host_bound(None, 1.0) and not host_bound(1.0, None) and not host_bound(1.0, 0.0)
