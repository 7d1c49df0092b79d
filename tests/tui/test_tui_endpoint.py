"""The console with a remote OpenAI-compatible endpoint as the engine (issue 20, TUI side).

The only TUI test with a test double of the engine handle: it emits what the endpoint client
emits (EngineInfo with `endpoint`, no GPU or launch times), so the display rules can be checked
without a server.
"""

from __future__ import annotations

import csv
import queue
import time

import pytest

from fgchat.engine.core import EngineConfig
from fgchat.metrics import read_requests_csv, read_tokens_csv
from fgchat.protocol.events import EngineInfo, Mode, RequestFinished, RequestSummary, SamplingParams, TokenEvent
from fgchat.tui.app import FgchatApp
from test_tui import data_dir, panel, type_prompt, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(60)

URL = "http://127.0.0.1:9/v1"


class EndpointHandle:
    """EngineProcess's interface; every prompt gets `n` tokens timed at the "client"."""

    pid = 0

    def __init__(self, n: int = 6) -> None:
        self.events: queue.Queue = queue.Queue()
        self.n = n
        self.modes: list[str] = []

    def start(self) -> None:
        self.events.put(EngineInfo(
            model_name="remote-model", architecture="", device="", dtype="", max_context=4096,
            num_layers=0, attention_backend="", available_modes={}, mode=Mode.EAGER, endpoint=URL))

    def submit_chats(self, messages, requests) -> None:
        t0 = time.monotonic_ns()
        for rid, _params in requests:
            for i in range(self.n):
                self.events.put(TokenEvent(rid, i, 5, f"w{i} ", Mode.EAGER, 1, t0 + i * 2_000_000,
                                           None if i == 0 else 2.0, None, i == 0, 10 + i))
            self.events.put(RequestFinished(RequestSummary(
                rid, 10, self.n, 3.0, 2.0, 3.0 + 2.0 * (self.n - 1), "length", "".join(f"w{i} " for i in range(self.n)))))

    def get_events(self, timeout: float) -> list:
        out = []
        try:
            out.append(self.events.get(timeout=timeout))
            while True:
                out.append(self.events.get_nowait())
        except queue.Empty:
            return out

    def set_mode(self, mode: str) -> None:
        self.modes.append(mode)

    def cancel(self, rid: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


async def test_endpoint_timings_are_labelled_client_side_and_exported_with_the_url(data_dir, tmp_path):
    handle = EndpointHandle()
    app = FgchatApp(EngineConfig(model="remote"), engine_factory=lambda cfg: handle,
                    sampling=SamplingParams(max_tokens=6))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the endpoint's info", 10)
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "the reply", 10)
        await wait_for(pilot, lambda: panel(app).view.total_tokens == 6, "panel refresh", 5)
        await pilot.pause(0.1)

        assert panel(app).text_of("timing-note").startswith("timings measured at client")
        assert URL in panel(app).text_of("engine-info")
        assert not panel(app).query_one("#gpu-host").display  # no GPU or launch time to show
        assert "ITL ms" in panel(app).text_of("stats")
        bar = panel(app).text_of("mode-bar")
        assert bar.count("n/a") == 3  # eager runs (the current mode); the other three are unavailable

        # mode keys: disabled (dimmed in the footer, a press does nothing); the palette's
        # command says why in one warning; nothing reaches the handle
        assert app.check_action("mode", ("full",)) is None
        assert app.check_action("mode", ("eager",)) is True
        await pilot.press("f3")
        app.action_mode("full")
        assert handle.modes == [] and app.link.mode == "eager"
        assert any(sev == "warning" and "full is unavailable" in text and "\n" not in text
                   for sev, text in app.notices)

        out = tmp_path / "remote-tokens.csv"
        assert app.log_files.export(out) is not None
    rows = read_tokens_csv(out)
    assert len(rows) == 6 and {r.endpoint for r in rows} == {URL}
    assert all(r.gpu_step_ms is None and r.launch_ms is None for r in rows)
    assert [r.endpoint for r in read_requests_csv(out.with_name("remote-requests.csv"))] == [URL]
    with open(out, newline="", encoding="utf-8") as f:
        assert next(csv.reader(f))[-1] == "endpoint"


async def test_local_engine_rows_have_an_empty_endpoint_and_no_client_label(data_dir, tiny_llama, tmp_path):
    from test_tui import make_app, wait_ready

    app = make_app(tiny_llama, thread=True, max_tokens=4)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "the reply")
        await pilot.pause(0.2)
        assert not panel(app).query_one("#timing-note").display
        assert app.check_action("mode", ("full",)) is True  # the engine answers with its fallback
        tokens_csv, _requests_csv = app.log_files.export(tmp_path / "local-tokens.csv")
    assert {r.endpoint for r in read_tokens_csv(tokens_csv)} == {""}
