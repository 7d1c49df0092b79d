"""The latency console's periodic refresh: a 10 Hz tick that syncs --log-csv and, when the
console is dirty, rebuilds its `PanelView` from a bounded window of the latency log.

Invariant: rebuilding is coalesced and throttled (at most ~20% of the UI thread), so a fast
token stream never makes the UI fall behind; the window limits keep each rebuild cheap.
"""

from __future__ import annotations

import time

import numpy as np
from textual.css.query import NoMatches

from fgchat.protocol.events import MODES
from fgchat.metrics import summarize_records
from fgchat.tui.latency_panel import LatencyPanel, PanelView

STATS_WINDOW_TOKENS = 5_000  # the stats table covers at most the latest tokens (stays fast)
STATS_WINDOW_REQUESTS = 1_000
HIST_WINDOW = 5_000  # each mode's histogram keeps that mode's latest inter-token latencies
RECENT_ITL = 240
REFRESH_S = 0.1


class ConsoleMixin:
    """FgchatApp's console refresh; uses the engine/reply state FgchatApp.__init__ creates."""

    def _update_subtitle(self) -> None:
        batch = self.batch_size_now
        mode = self.engine_mode + (f"→{self.requested_mode}?" if self.requested_mode and
                                   self.requested_mode != self.engine_mode else "")
        if self.engine_state == "failed":
            model = "engine stopped"
        else:
            model = self.engine_info.model_name if self.engine_info else "loading…"
        self.sub_title = f"{model} · {mode} · batch {batch} · K {self.samples}"

    def _tick(self) -> None:
        if self._flushed:
            return
        if self.appender is not None:
            self._sync_csv()
        now = time.monotonic()
        if self.engine_state == "starting":
            self._dirty = True  # the start-up line shows the elapsed time
        if not self._dirty or now < self._next_build:
            return
        self._dirty = False
        self.panel_view = self._build_view()
        # keep recomputation under ~20% of the UI thread even with a long, fast log
        self._next_build = now + max(REFRESH_S, 5 * (time.monotonic() - now))
        if self.panel_view.batch_size:
            self.batch_sizes_shown.add(self.panel_view.batch_size)
        try:
            self.query_one(LatencyPanel).show(self.panel_view)
        except NoMatches:  # shutting down
            return
        self._update_subtitle()
        for view in self.chat_views():
            self._update_tab(view.conversation)

    def _build_view(self) -> PanelView:
        count = self.latency_log.token_count
        start = max(0, count - STATS_WINDOW_TOKENS)
        tokens = self.latency_log.tokens_since(start)
        requests = self.latency_log.requests()[-STATS_WINDOW_REQUESTS:]
        return PanelView(
            mode=self.engine_mode,
            requested_mode=self.requested_mode,
            mode_note=self.mode_note,
            batch_size=self.batch_size_now,
            last_batch_size=self.last_batch_size,
            samples=self.samples,
            active_replies=len(self.replies),
            summary=summarize_records(tokens, requests),
            itl_by_mode={m: np.fromiter(self.itl_history.get(m, ()), dtype=np.float64) for m in MODES},
            recent_itl=list(self.recent_itl),
            windowed=len(tokens) if start else 0,
            total_tokens=count,
            info=self.engine_info,
            engine_state=self.engine_state,
            engine_error=self.engine_error,
            engine_phase=getattr(self, "engine_phase", ""),
            starting_s=time.monotonic() - getattr(self, "engine_started_at", time.monotonic()),
            last_export=str(getattr(self, "last_export_path", "") or ""),
        )
