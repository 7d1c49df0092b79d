"""Latency records, statistics, histograms and CSV export.

Invariant: nothing in this package imports Textual or Rich (the TUI wraps what it renders).
"""

from fgchat.metrics.csv_export import (
    CsvAppender,
    read_requests_csv,
    read_session_ids,
    read_tokens_csv,
    write_requests_csv,
    write_tokens_csv,
)
from fgchat.metrics.histogram import histogram, render_bars, shared_bins, sparkline
from fgchat.metrics.records import (
    REQUEST_COLUMNS,
    SESSION_COLUMN,
    TOKEN_COLUMNS,
    LatencyLog,
    RequestRecord,
    TokenRecord,
    new_session_id,
)
from fgchat.metrics.stats import (
    HOST_BOUND_FRACTION,
    Stats,
    bandwidth_share,
    host_bound,
    itl_by_mode,
    latency_summary,
    request_tpot_ms,
    summarize,
    summarize_records,
)
from fgchat.metrics.window_summary import RecentItl, WindowSummary

__all__ = [
    "HOST_BOUND_FRACTION",
    "REQUEST_COLUMNS",
    "SESSION_COLUMN",
    "TOKEN_COLUMNS",
    "CsvAppender",
    "LatencyLog",
    "RequestRecord",
    "Stats",
    "TokenRecord",
    "RecentItl",
    "WindowSummary",
    "histogram",
    "bandwidth_share",
    "host_bound",
    "itl_by_mode",
    "latency_summary",
    "new_session_id",
    "read_requests_csv",
    "read_session_ids",
    "read_tokens_csv",
    "render_bars",
    "request_tpot_ms",
    "shared_bins",
    "sparkline",
    "summarize",
    "summarize_records",
    "write_requests_csv",
    "write_tokens_csv",
]
