"""The latency console's model: the latency log, the batch sizes seen, and the `PanelView` the
panel draws, rebuilt from bounded windows of the log.

Invariants:
- The log is the one source of latencies: the stats table, the per-mode histograms and the
  sparkline are all windows of its records (`WindowSummary`, `LatencyLog.recent_itl`); the
  stats table's columns only ever take the log's records in arrival order and drop the oldest.
- Every token and finished request is recorded here before any UI shows it.
- Rebuilding is coalesced and throttled: only when something shown changed, at most every
  `refresh_s` (longer while the engine computes on this machine's CPU), and at most ~20% of
  the UI thread, so a fast token stream never makes the UI fall behind; the windows keep each
  rebuild O(window), whatever the log's length, and the stats table and the histograms' windows
  convert each record once (Python work per rebuild: the records added since the last).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, fields

from fgchat.metrics import LatencyLog, RecentItl, WindowSummary
from fgchat.metrics.spec_window import SpecWindow
from fgchat.protocol.events import MODES, REMOTE_MODE, EngineInfo, RequestSummary, TokenEvent
from fgchat.tui.latency_panel import PanelView

STATS_WINDOW_TOKENS = 5_000  # the stats table covers at most the latest tokens (stays fast)
STATS_WINDOW_REQUESTS = 1_000
HIST_WINDOW = 5_000  # each mode's histogram shows that mode's latest inter-token latencies
SPEC_WINDOW_STEPS = 1_000  # the speculation line covers the latest speculated steps
RECENT_ITL = 240  # the sparkline's latest inter-token latencies (any mode)
REFRESH_S = 0.1
CPU_REFRESH_S = 0.5  # while the engine computes on this machine's CPU (it needs the cores)


@dataclass(frozen=True)
class PanelStatus:
    """What the panel shows besides the log: engine state and the user's choices. Field names
    are PanelView's."""

    mode: str = "eager"
    ran_mode: str = ""
    requested_mode: str | None = None
    mode_note: str = ""
    unavailable: tuple[tuple[str, str], ...] = ()
    samples: int = 1
    sampling: str = ""
    active_replies: int = 0
    info: EngineInfo | None = None
    engine_state: str = "starting"
    engine_error: str = ""
    engine_phase: str = ""
    starting_s: float = 0.0
    ready_s: float | None = None
    last_export: str = ""
    speculate: str = "off"  # the method the engine reports ("off" | "ngram" | "draft" | "oracle")


class LatencyConsole:
    """Owns the latency log; `rebuild(status)` gives a new PanelView when one is due."""

    def __init__(self, session_id: str = "") -> None:
        self.log = LatencyLog(session_id=session_id)
        self.stats = WindowSummary(self.log, STATS_WINDOW_TOKENS, STATS_WINDOW_REQUESTS)
        self.itl_windows = RecentItl(self.log, HIST_WINDOW)
        self.spec_window = SpecWindow(self.log, SPEC_WINDOW_STEPS)
        self.batch_size_now = 0  # batch of the latest decode step; 0 once no reply is in flight
        self.last_batch_size = 0
        self.batch_sizes_seen: Counter[int] = Counter()  # decode batch sizes of tokens received
        self.view = PanelView()
        self._shown: tuple | None = None  # what the current view was built from
        self._next_build = 0.0  # monotonic time before which no rebuild starts
        self.refresh_s = REFRESH_S  # shortest time between rebuilds (CPU_REFRESH_S: engine on CPU)

    # ---- recording -----------------------------------------------------------------------
    def record_tokens(self, tokens: list[TokenEvent], chat_of, endpoint: str = "") -> None:
        """Log the tokens (`chat_of(request_id)` names their chat) and note their batch sizes."""
        for ev in tokens:
            self.log.add_token(ev, chat_of(ev.request_id), endpoint=endpoint)
            if not ev.is_first_token:
                self.batch_size_now = self.last_batch_size = ev.batch_size
                self.batch_sizes_seen[ev.batch_size] += 1

    def record_requests(self, summaries: list[RequestSummary], chat_of, endpoint: str = "") -> None:
        for summary in summaries:
            self.log.add_request(summary, chat_of(summary.request_id), endpoint=endpoint)

    def idle(self) -> None:
        """No reply is in flight: the batch size is 0."""
        self.batch_size_now = 0

    # ---- view ----------------------------------------------------------------------------
    def rebuild(self, status: PanelStatus, early: float = 0.0) -> PanelView | None:
        """A new view when something shown changed and the throttle allows (a rebuild due
        within `early` seconds counts as due); else None."""
        now = time.monotonic()
        key = (status, self.log.token_count, self.log.request_count, self.batch_size_now,
               int(status.starting_s) if status.engine_state == "starting" else 0)
        if key == self._shown or now + early < self._next_build:
            return None
        self._shown = key
        self.view = self.build(status)
        # keep recomputation under ~20% of the UI thread even with a long, fast log
        self._next_build = now + max(self.refresh_s, 5 * (time.monotonic() - now))
        return self.view

    def build(self, status: PanelStatus) -> PanelView:
        summary = self.stats.summary()
        count = self.stats.tokens_seen
        return PanelView(
            **{f.name: getattr(status, f.name) for f in fields(status)},
            batch_size=self.batch_size_now,
            last_batch_size=self.last_batch_size,
            summary=summary,
            itl_by_mode=self.itl_windows.by_mode((*MODES, REMOTE_MODE)),
            recent_itl=self.log.recent_itl(RECENT_ITL),
            windowed=self.stats.window_tokens if count > STATS_WINDOW_TOKENS else 0,
            total_tokens=count,
            # the stats window's mean GPU step time (read incrementally, as the table is)
            recent_gpu_ms=summary.get("gpu_step_ms_mean") if summary else None,
            spec=self.spec_window.figures(),
        )
