"""Each mode's latest inter-token latencies (the console's histograms) without rescanning the log:
`RecentItl` equals `LatencyLog.recent_itl` value for value, and a console rebuild reads only the
records added since the last one (plus the sparkline's fixed window), however long the log."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fgchat.metrics import LatencyLog, RecentItl
from fgchat.metrics.stats import clean
from fgchat.protocol.events import MODES, TokenEvent
from fgchat.tui.latency_console import RECENT_ITL, LatencyConsole, PanelStatus


def add_tokens(log: LatencyLog, n: int, rng: random.Random, start_rid: int = 1) -> None:
    for i in range(n):
        first = rng.random() < 0.05
        log.add_token(TokenEvent(
            request_id=start_rid + i // 50, token_index=i % 50, token_id=1, text="x",
            mode=rng.choice(MODES), batch_size=rng.choice([1, 2, 8]), t_ns=log.start_ns + i * 1_000_000,
            itl_ms=None if first or rng.random() < 0.02 else rng.uniform(1.0, 40.0), gpu_step_ms=None,
            is_first_token=first, position=10 + i % 50,
        ), "chat")


@pytest.mark.parametrize("limit", [1, 7, 300])
def test_recent_itl_windows_equal_the_logs_own(limit):
    rng = random.Random(limit)
    log = LatencyLog()
    windows = RecentItl(log, limit)
    for batch in [0, 1, 3, 250, 0, 40, 900]:
        add_tokens(log, batch, rng)
        got = windows.by_mode(MODES)
        assert list(got) == list(MODES)
        for mode in MODES:
            expected = np.asarray(log.recent_itl(limit, mode), dtype=np.float64)
            assert got[mode].dtype == np.float64
            assert got[mode].tolist() == expected.tolist(), (batch, mode)


def test_clean_of_a_float_array_equals_clean_of_its_values():
    values = np.array([3.0, np.nan, -1.5, np.inf, 2.0, -np.inf], dtype=np.float32)
    assert clean(values).tolist() == clean(values.tolist()).tolist() == [3.0, -1.5, 2.0]
    assert clean(values).dtype == np.float64
    assert clean([1, None, 2.5]).tolist() == [1.0, 2.5]


def test_a_console_rebuild_reads_only_the_new_records(monkeypatch):
    """Counted, not timed: the records the log hands out for one rebuild."""
    handed = [0]

    def counting(method):
        def wrapper(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            handed[0] += len(out)
            return out
        return wrapper

    for name in ("tokens", "tokens_since", "recent_itl", "requests", "requests_since"):
        monkeypatch.setattr(LatencyLog, name, counting(getattr(LatencyLog, name)))
    monkeypatch.setattr(LatencyLog, "snapshot", lambda self: pytest.fail("a rebuild copies the whole log"))

    rng = random.Random(0)
    console = LatencyConsole()
    add_tokens(console.log, 20_000, rng)
    first = console.build(PanelStatus())
    assert first.total_tokens == 20_000
    for new in (10, 1, 200):
        add_tokens(console.log, new, rng, start_rid=10_000)
        handed[0] = 0
        view = console.build(PanelStatus())
        # the stats table, the histograms and the speculation window each read the new records
        # once; the sparkline its window
        assert handed[0] <= 3 * new + RECENT_ITL, (new, handed[0])
        for mode in MODES:
            assert view.itl_by_mode[mode].tolist() == console.log.recent_itl(5_000, mode)
