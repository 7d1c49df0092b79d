"""`summarize_records` of a growing log's latest records, and each mode's latest inter-token
latencies, without rescanning them.

Invariants:
- `WindowSummary.summary()` equals `summarize_records(tokens[-T:], requests[-R:])` of the log's
  records at the time of the call (T, R: the windows), float for float.
- Each record is converted to numbers once, when it is first seen; the columns hold only the
  latest T tokens and R requests (values, None as NaN), in arrival order.
- An unchanged log (same token and request counts) returns the previous summary without work.
- `RecentItl.by_mode()[m]` equals `log.recent_itl(limit, m)` as a float64 array, value for value;
  each record is read once, so a call costs O(records added since the last) in Python and
  O(limit) only in numpy, however long the log.
- The arrays handed out are never written to afterwards (each update makes new ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fgchat.metrics.records import LatencyLog
from fgchat.metrics.stats import floats, request_tpot_ms, summary_figures


class WindowSummary:
    """Figures of the latest `tokens` token records and `requests` request records of `log`."""

    def __init__(self, log: LatencyLog, tokens: int, requests: int) -> None:
        if tokens < 1 or requests < 1:
            raise ValueError(f"windows must hold at least one record, got {tokens} and {requests}")
        self.log = log
        self.token_window = tokens
        self.request_window = requests
        self.tokens_seen = 0  # token records of the log converted so far
        self.requests_seen = 0
        empty = np.empty(0, dtype=np.float64)
        # per token: ITL, GPU step, launch (NaN when None), batch size, decode (non-first, ITL set)
        self._itl, self._gpu, self._launch = empty, empty, empty
        self._batch = np.empty(0, dtype=np.int64)
        self._decode = np.empty(0, dtype=bool)
        # per request: TTFT, TPOT (NaN when None)
        self._ttft, self._tpot = empty, empty
        self._summary: dict[str, Any] | None = None

    @property
    def window_tokens(self) -> int:
        """Token records the summary covers (at most `token_window`)."""
        return int(self._itl.size)

    def summary(self) -> dict[str, Any]:
        """`summarize_records` of the windows (mode and batch_size None); a fresh dict."""
        changed = self._take_new()
        if changed or self._summary is None:
            decode = self._decode
            self._summary = {"mode": None, "batch_size": None, "tokens": self.window_tokens}
            self._summary.update(summary_figures(
                ttft=self._ttft[np.isfinite(self._ttft)],
                tpot=self._tpot[np.isfinite(self._tpot)],
                itl=self._itl[decode],
                gpu=self._gpu[decode],
                launch=self._launch[decode],
                batch=self._batch[decode],
            ))
        return dict(self._summary)

    def _take_new(self) -> bool:
        """Append the records added since the last call to the columns; whether there were any."""
        tokens = self.log.tokens_since(self.tokens_seen)
        requests = self.log.requests_since(self.requests_seen)
        self.tokens_seen += len(tokens)
        self.requests_seen += len(requests)
        if tokens:
            keep = self.token_window
            shown = tokens[-keep:]
            self._itl = _tail(self._itl, floats(t.itl_ms for t in shown), keep)
            self._gpu = _tail(self._gpu, floats(t.gpu_step_ms for t in shown), keep)
            self._launch = _tail(self._launch, floats(t.launch_ms for t in shown), keep)
            self._batch = _tail(self._batch, [t.batch_size for t in shown], keep)
            self._decode = _tail(
                self._decode, [not t.is_first_token and t.itl_ms is not None for t in shown], keep
            )
        if requests:
            keep = self.request_window
            shown_requests = requests[-keep:]
            self._ttft = _tail(self._ttft, [r.ttft_ms for r in shown_requests], keep)
            self._tpot = _tail(self._tpot, floats(request_tpot_ms(r) for r in shown_requests), keep)
        return bool(tokens or requests)


def _tail(column: np.ndarray, new: list[Any] | np.ndarray, keep: int) -> np.ndarray:
    """The latest `keep` entries of `column` followed by `new`."""
    joined = np.concatenate([column, np.asarray(new, dtype=column.dtype)])
    return joined[-keep:] if joined.size > keep else joined


class RecentItl:
    """The latest `limit` inter-token latencies of each mode of `log` (the mode that ran their
    step), oldest first, as float64 arrays: the per-mode histograms' input."""

    def __init__(self, log: LatencyLog, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the window must hold at least one value, got {limit}")
        self.log = log
        self.limit = limit
        self.tokens_seen = 0  # token records of the log read so far
        self._columns: dict[str, np.ndarray] = {}

    def by_mode(self, modes: Iterable[str]) -> dict[str, np.ndarray]:
        """Each of `modes` -> its window (an empty array for a mode without values)."""
        tokens = self.log.tokens_since(self.tokens_seen)
        self.tokens_seen += len(tokens)
        new: dict[str, list[float]] = {}
        for t in tokens:
            if not t.is_first_token and t.itl_ms is not None:
                new.setdefault(t.mode, []).append(t.itl_ms)
        for mode, values in new.items():
            self._columns[mode] = _tail(self._columns.get(mode, _EMPTY), values[-self.limit:], self.limit)
        return {m: self._columns.get(str(m), _EMPTY) for m in modes}


_EMPTY = np.empty(0, dtype=np.float64)
