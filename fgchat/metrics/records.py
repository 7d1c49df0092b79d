"""Token and request latency records, and the in-memory log that holds them.

Invariants:
- A `LatencyLog` only ever grows: records are appended, never edited or dropped, so a user's
  log survives any failed export (CSV errors leave the in-memory data untouched).
- Token records are stored in arrival order; `tokens()[i]` is the i-th token ever added, so a
  caller can remember an index and later ask for `tokens_since(i)`.
- Every public method takes the log's lock; snapshots are fresh lists of frozen records, safe to
  read from another thread while the engine keeps adding.
- The log is the one source of inter-token latencies: its per-mode index (positions of the
  records that carry an ITL) is updated under the same lock as the records, so windowed queries
  (`recent_itl`) always agree with `tokens()`.
"""

from __future__ import annotations

import secrets
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

from fgchat.protocol.events import MODES, RequestSummary, TokenEvent

# CSV column order; `TokenRecord` / `RequestRecord` fields are declared in exactly this order.
TOKEN_COLUMNS: tuple[str, ...] = (
    "request_id",
    "chat_id",
    "token_index",
    "mode",
    "batch_size",
    "t_ms",
    "itl_ms",
    "gpu_step_ms",
    "is_first_token",
    "prompt_tokens",
    "position",
    "launch_ms",
    "endpoint",
    "step_id",
    "drafted",
    "draft_len",
    "accepted_in_step",
    "spec_method",
)

# Files written for a session (the TUI's --log-csv and exports) put this column first: request
# ids restart at 1 and t_ms at 0 in every session, so (session_id, request_id, chat_id,
# token_index) is what is unique across sessions appended to one file.
SESSION_COLUMN = "session_id"


def new_session_id() -> str:
    """A new session id: UTC start time (sorts by start) plus 8 random hex digits (two sessions
    started in the same second differ), e.g. "20250131T235959Z-3f9a0c1d"."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id",
    "chat_id",
    "modes",
    "batch_size_max",
    "prompt_tokens",
    "output_tokens",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "finish_reason",
    "endpoint",
    "cached_tokens",
    "spec_method",
    "spec_draft_len",
    "spec_proposed",
    "spec_accepted",
    "spec_acceptance_rate",
    "spec_tokens_per_step",
)


@dataclass(frozen=True)
class TokenRecord:
    """One emitted token: one row of the tokens CSV."""

    request_id: int
    chat_id: str
    token_index: int  # 0 for the first generated token
    mode: str  # mode that ran the step producing this token ("eager" for prefill)
    batch_size: int
    t_ms: float  # host monotonic time relative to the log's start, in ms
    itl_ms: float | None  # None for the first token of a request
    gpu_step_ms: float | None  # None when no GPU timing exists (CPU)
    is_first_token: bool
    prompt_tokens: int
    position: int  # prompt_tokens + token_index
    launch_ms: float | None = None  # host time to enqueue the step; None for the first token
    endpoint: str = ""  # URL of the remote server that produced it; "" for the local engine
    step_id: int = -1  # decode step of its request that produced it; -1 for prefill's token
    drafted: bool = False  # a drafted token the target accepted
    draft_len: int = 0  # tokens proposed in that step; 0 without speculation
    accepted_in_step: int = 0  # drafted tokens accepted in that step
    spec_method: str = ""  # "ngram" | "draft" | "oracle"; "" without speculation


@dataclass(frozen=True)
class RequestRecord:
    """One finished request: one row of the requests CSV."""

    request_id: int
    chat_id: str
    # tokens per mode that produced them, e.g. {"eager": 1, "full": 31}; keys in MODES order first
    modes: dict[str, int] = field(hash=False)
    batch_size_max: int | None  # largest batch any of its tokens ran in; None if no token was seen
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float | None  # None with fewer than two output tokens
    e2e_ms: float
    finish_reason: str
    endpoint: str = ""  # URL of the remote server that served it; "" for the local engine
    cached_tokens: int = 0  # prompt tokens not prefilled again: their K/V rows were in the slot
    # RequestSummary.spec flattened; "" / None when the request ran without speculation
    spec_method: str = ""
    spec_draft_len: int | None = None
    spec_proposed: int | None = None
    spec_accepted: int | None = None
    spec_acceptance_rate: float | None = None
    spec_tokens_per_step: float | None = None


def format_modes(modes: dict[str, int]) -> str:
    """{"eager": 1, "full": 31} -> "eager:1;full:31" (known modes first, in MODES order)."""
    return ";".join(f"{m}:{n}" for m, n in _ordered_modes(modes).items())


def parse_modes(text: str) -> dict[str, int]:
    """Inverse of `format_modes`; "" -> {}."""
    out: dict[str, int] = {}
    for part in text.split(";"):
        if part:
            name, _, count = part.partition(":")
            out[name] = int(count)
    return out


def _ordered_modes(modes: dict[str, int]) -> dict[str, int]:
    known = {m: modes[m] for m in MODES if modes.get(m)}
    rest = {m: n for m, n in sorted(modes.items()) if m not in MODES and n}
    return known | rest


def spec_fields(spec: dict | None) -> dict[str, object]:
    """RequestRecord's spec_* fields from RequestSummary.spec (None: the defaults)."""
    if not spec:
        return {}

    def num(key: str, kind: type) -> object:
        value = spec.get(key)
        return None if value is None else kind(value)

    return {"spec_method": str(spec.get("method") or ""), "spec_draft_len": num("draft_len", int),
            "spec_proposed": num("proposed", int), "spec_accepted": num("accepted", int),
            "spec_acceptance_rate": num("acceptance_rate", float),
            "spec_tokens_per_step": num("tokens_per_step", float)}


class LatencyLog:
    """Thread-safe, append-only, in-memory store of token and request records.

    `t_ms` of each token is `(event.t_ns - start_ns) / 1e6`. `start_ns` defaults to
    `time.monotonic_ns()` when the log is created; CLOCK_MONOTONIC is system-wide on Linux, so
    events stamped in the engine process are comparable. `session_id` names this log's run (and
    time base) in CSV files; "" when none was given.
    """

    def __init__(self, start_ns: int | None = None, session_id: str = "") -> None:
        self.start_ns: int = time.monotonic_ns() if start_ns is None else int(start_ns)
        self.session_id = session_id
        self._lock = threading.Lock()
        self._tokens: list[TokenRecord] = []
        self._requests: list[RequestRecord] = []
        # per request_id: (largest batch size seen, tokens per mode) — used to fill RequestRecord
        self._batch_max: dict[int, int] = {}
        self._mode_counts: dict[int, Counter[str]] = {}
        # positions in _tokens of the records with an ITL (non-first tokens), per mode and overall
        self._itl_rows: dict[str, array] = {}
        self._itl_all = array("q")

    # --- adding -----------------------------------------------------------------------------

    def add_token(
        self, event: TokenEvent, chat_id: str, prompt_tokens: int | None = None, endpoint: str = ""
    ) -> TokenRecord:
        """Record one token event and return its record.

        prompt_tokens defaults to `event.position - event.token_index`; `endpoint` is the URL of the
        remote server that produced it ("" for the local engine).
        """
        if prompt_tokens is None:
            prompt_tokens = event.position - event.token_index
        record = TokenRecord(
            request_id=event.request_id,
            chat_id=chat_id,
            token_index=event.token_index,
            mode=str(event.mode),
            batch_size=event.batch_size,
            t_ms=(event.t_ns - self.start_ns) / 1e6,
            itl_ms=None if event.itl_ms is None else float(event.itl_ms),
            gpu_step_ms=None if event.gpu_step_ms is None else float(event.gpu_step_ms),
            is_first_token=bool(event.is_first_token),
            prompt_tokens=int(prompt_tokens),
            position=event.position,
            launch_ms=None if event.launch_ms is None else float(event.launch_ms),
            endpoint=endpoint,
            step_id=int(event.step_id),
            drafted=bool(event.drafted),
            draft_len=int(event.draft_len),
            accepted_in_step=int(event.accepted_in_step),
            spec_method=str(event.spec_method),
        )
        with self._lock:
            if not record.is_first_token and record.itl_ms is not None:
                row = len(self._tokens)
                self._itl_rows.setdefault(record.mode, array("q")).append(row)
                self._itl_all.append(row)
            self._tokens.append(record)
            rid = record.request_id
            self._batch_max[rid] = max(self._batch_max.get(rid, 0), record.batch_size)
            self._mode_counts.setdefault(rid, Counter())[record.mode] += 1
        return record

    def add_request(self, summary: RequestSummary, chat_id: str, endpoint: str = "") -> RequestRecord:
        """Record a finished request and return its record (`endpoint` as in `add_token`).

        modes come from `summary.mode_counts`, or, when that is empty, from the tokens this log
        saw for the request; batch_size_max always comes from those tokens (None if none).
        """
        with self._lock:
            rid = summary.request_id
            seen_modes = dict(self._mode_counts.get(rid, {}))
            batch_max = self._batch_max.get(rid)
            record = RequestRecord(
                request_id=rid,
                chat_id=chat_id,
                modes=_ordered_modes(dict(summary.mode_counts) or seen_modes),
                batch_size_max=batch_max,
                prompt_tokens=summary.prompt_tokens,
                output_tokens=summary.output_tokens,
                ttft_ms=float(summary.ttft_ms),
                tpot_ms=None if summary.tpot_ms is None else float(summary.tpot_ms),
                e2e_ms=float(summary.e2e_ms),
                finish_reason=str(summary.finish_reason),
                endpoint=endpoint,
                cached_tokens=int(summary.cached_tokens),
                **spec_fields(summary.spec),
            )
            self._requests.append(record)
        return record

    # --- reading (snapshots) ----------------------------------------------------------------

    def tokens(self, mode: str | None = None) -> list[TokenRecord]:
        """Snapshot of all token records (optionally only those produced in `mode`)."""
        with self._lock:
            if mode is None:
                return list(self._tokens)
            return [t for t in self._tokens if t.mode == mode]

    def tokens_since(self, index: int) -> list[TokenRecord]:
        """Token records with position >= index in arrival order (for incremental consumers)."""
        with self._lock:
            return self._tokens[max(0, index) :]

    def recent_itl(self, limit: int, mode: str | None = None) -> list[float]:
        """Inter-token latencies (ms) of the latest `limit` tokens that have one (non-first tokens),
        of `mode` (the mode that ran their step) or of any mode; oldest first. Costs O(limit)."""
        with self._lock:
            rows = self._itl_all if mode is None else self._itl_rows.get(str(mode))
            if not rows or limit <= 0:
                return []
            tokens = self._tokens
            return [tokens[i].itl_ms for i in rows[-limit:]]  # type: ignore[misc]

    def requests_since(self, index: int) -> list[RequestRecord]:
        """Request records with position >= index in the order they were added."""
        with self._lock:
            return self._requests[max(0, index) :]

    def requests(self) -> list[RequestRecord]:
        """Snapshot of all finished-request records, in the order they were added."""
        with self._lock:
            return list(self._requests)

    def snapshot(self) -> tuple[list[TokenRecord], list[RequestRecord]]:
        """Tokens and requests taken under one lock, so they are mutually consistent."""
        with self._lock:
            return list(self._tokens), list(self._requests)

    @property
    def token_count(self) -> int:
        with self._lock:
            return len(self._tokens)

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self._requests)

    def __len__(self) -> int:
        return self.token_count
