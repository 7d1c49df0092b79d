"""The title and the histogram marker show the mode that ran the latest step, and the chosen one
beside it where they differ; a mode the engine cannot run says why (issue 52 item 1). Pilot, a
real engine on a tiny model in a thread (CPU), its graph modes stood in for."""

from __future__ import annotations

import pytest

from fgchat.engine.core import Engine
from fgchat.protocol.events import Mode
from fgchat.tui.histogram import ModeHistograms
from test_mode_honesty import PendingCaptureMode
from test_tui import GraphlessModesEngine, SIZE, data_dir, key, make_app, panel, type_prompt, wait_for, wait_ready

pytestmark = pytest.mark.timeout(120)
__all__ = ["data_dir"]  # the fixture, used by name


class SilentSubstituteEngine(GraphlessModesEngine):
    """Reports full as its mode but runs each decode step eager: the substitution the issue saw
    (engine and panel said full, the tokens ran eager), whatever causes it."""

    def _launch(self, seqs, prev):
        chosen, self.mode = self.mode, Mode.EAGER
        try:
            return super()._launch(seqs, prev)
        finally:
            self.mode = chosen


class FailingCaptureEngine(Engine):
    """Full mode "available" whose capture of any batch size fails."""

    def _make_modes(self):
        modes = super()._make_modes()
        modes.install(Mode.FULL, PendingCaptureMode(self, fail=True))
        return modes


async def _choose_full(pilot, app) -> None:
    await wait_ready(pilot, app)
    await key(pilot, "f3")
    await wait_for(pilot, lambda: app.link.mode == "full", "the engine to confirm full")


def _marks(app) -> tuple[str, str]:
    hist = panel(app).query_one(ModeHistograms)
    return hist.current_mode, hist.chosen_mode


async def test_title_and_marker_show_the_mode_that_ran(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=400, max_context=1024, make_engine=SilentSubstituteEngine)
    async with app.run_test(size=SIZE) as pilot:
        await _choose_full(pilot, app)
        assert " · full · " in app.sub_title  # nothing ran yet: the chosen mode
        await type_prompt(pilot, "Tell me a story")
        await wait_for(pilot, lambda: app.latency.log.token_count >= 4, "decode tokens")
        await wait_for(pilot, lambda: " · eager (chosen full) · " in app.sub_title, "the title to tell")
        await wait_for(pilot, lambda: _marks(app) == ("eager", "full"), "the marker on eager")
        text = str(panel(app).query_one(ModeHistograms).render())
        assert "▶eager" in text and "▷full" in text
        await key(pilot, "escape")
        await wait_for(pilot, lambda: not app.replies, "the reply to stop")


async def test_a_mode_that_cannot_run_says_why(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=12, max_context=1024, make_engine=FailingCaptureEngine)
    async with app.run_test(size=SIZE) as pilot:
        await _choose_full(pilot, app)
        await type_prompt(pilot, "Hello")
        await wait_for(pilot, lambda: app.link.mode == "eager", "the fallback")
        await wait_for(pilot, lambda: not app.replies, "the reply to end")
        why = "full could not run batch size 1 (graph capture failed"
        assert any(why in text for _, text in app.notices), app.notices[-3:]
        await wait_for(pilot, lambda: why in panel(app).text_of("mode-note"), "the reason in the panel")
        assert " · eager · " in app.sub_title and _marks(app) == ("eager", "eager")
        assert all(t.mode == "eager" for t in app.latency.log.tokens())
