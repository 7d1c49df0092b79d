"""The chat's next turn on a CPU engine: the real app and engine process on the tiny model; the
second reply's prompt starts with the first turn's, so its prefill skips those tokens
(engine.prefix_reuse) and its stats line and the requests log say how many."""

from __future__ import annotations

import pytest

from test_tui import SIZE, assistant_bubbles, data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)

LONG = " ".join(f"word{i}" for i in range(60))  # well over MIN_REUSE tokens on its own


async def test_the_second_turn_reuses_the_first_turns_tokens(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, LONG)
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "the first reply")
        await type_prompt(pilot, "and again")
        await wait_for(pilot, lambda: app.latency.log.request_count == 2 and not app.replies, "the second reply")
        first, second = app.latency.log.requests()
        assert first.cached_tokens == 0
        assert second.cached_tokens >= first.prompt_tokens > 32
        assert second.cached_tokens < second.prompt_tokens
        status = assistant_bubbles(app)[-1].status
        assert f"({second.cached_tokens} cached)" in status, status
        assert "cached" not in assistant_bubbles(app)[0].status
