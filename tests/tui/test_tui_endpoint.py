"""The console with a remote OpenAI-compatible endpoint as the engine (issue 20, TUI side).

A test double of the engine handle emits what the endpoint client emits (EngineInfo with
`endpoint`, no GPU or launch times), so the display rules can be checked without a server; the
real EndpointClient drives the console against scripted servers that are not fgchat
(tests/serve/fake_openai.py) for K = 2 replies.
"""

from __future__ import annotations

import csv
import queue
import time

import pytest

from fake_openai import FakeServer
from fgchat.client.handle import endpoint_factory
from fgchat.engine.core import EngineConfig
from fgchat.metrics import read_requests_csv, read_tokens_csv
from fgchat.protocol.events import EngineInfo, Mode, RequestFinished, RequestSummary, SamplingParams, TokenEvent
from fgchat.tui.histogram import ModeHistograms
from fgchat.tui.app import FgchatApp
from test_tui import assistant_bubbles, data_dir, panel, type_prompt, wait_for  # noqa: F401

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

        # a mode key the endpoint cannot switch to says why in one warning (the palette's
        # command too); nothing reaches the handle
        await pilot.press("f3")
        await pilot.pause(0.05)
        assert handle.modes == [] and app.link.mode == "eager"
        why = [text for sev, text in app.notices if sev == "warning" and "full is unavailable" in text]
        assert len(why) == 1 and "\n" not in why[0] and URL in why[0]
        app.action_mode("mega")
        assert any("mega is unavailable" in text for _sev, text in app.notices) and handle.modes == []

        out = tmp_path / "remote-tokens.csv"
        assert app.log_files.export(out) is not None
    rows = read_tokens_csv(out)
    assert len(rows) == 6 and {r.endpoint for r in rows} == {URL}
    assert all(r.gpu_step_ms is None and r.launch_ms is None for r in rows)
    assert [r.endpoint for r in read_requests_csv(out.with_name("remote-requests.csv"))] == [URL]
    with open(out, newline="", encoding="utf-8") as f:
        assert "endpoint" in next(csv.reader(f))


async def test_local_engine_rows_have_an_empty_endpoint_and_no_client_label(data_dir, tiny_llama, tmp_path):
    from test_tui import make_app, wait_ready

    app = make_app(tiny_llama, thread=True, max_tokens=4)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "the reply")
        await pilot.pause(0.2)
        assert not panel(app).query_one("#timing-note").display
        tokens_csv, _requests_csv = app.log_files.export(tmp_path / "local-tokens.csv")
    assert {r.endpoint for r in read_tokens_csv(tokens_csv)} == {""}


def _remote_app(base: str) -> FgchatApp:
    return FgchatApp(EngineConfig(model="remote"), engine_factory=endpoint_factory(base),
                     sampling=SamplingParams(max_tokens=50))


async def test_k2_replies_each_end_on_their_own_finish_and_are_labelled_remote(data_dir, tmp_path):
    with FakeServer("early", tokens=40) as fake:  # reply 1 stops at word 3, reply 2 streams 40
        app = _remote_app(fake.base)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.link.state == "ready", "the endpoint's info", 15)
            assert " · remote · " in app.sub_title  # nothing says the server runs "eager"
            app.set_samples(2)
            await type_prompt(pilot, "hi")
            await wait_for(pilot, lambda: app.latency.log.request_count == 1 and 1 not in app.replies,
                           "reply 1 to end", 15)
            await pilot.pause(0.05)
            first, second = assistant_bubbles(app)
            assert 2 in app.replies, "reply 1 ended only when reply 2 did"  # reply 2 still streams
            assert first.status and not any(w in first.status for w in ("generating", "cancel", "error"))
            assert second.status == "generating…"
            await wait_for(pilot, lambda: not app.replies, "reply 2 to end", 15)
            ends = {r.request_id: r for r in app.latency.log.requests()}
            assert ends[1].finish_reason == "stop" and ends[1].output_tokens == 3
            assert ends[2].finish_reason == "length" and ends[2].output_tokens == 40
            await wait_for(pilot, lambda: panel(app).view.total_tokens == 43, "panel refresh", 5)
            assert panel(app).view.itl_by_mode["remote"].size == 2 + 39  # every ITL, under remote
            hist = panel(app).query_one(ModeHistograms)
            await wait_for(pilot, lambda: hist.series.get("remote", ()).size == 41, "the remote band", 5)
            assert "remot" in str(hist.render())  # drawn as a band of its own, not dropped
            out = tmp_path / "tokens.csv"
            assert app.log_files.export(out) is not None
    assert {r.mode for r in read_tokens_csv(out)} == {"remote"}


async def test_k2_replies_from_a_server_that_ignores_n_both_arrive(data_dir):
    with FakeServer("ignore_n", tokens=5) as fake:
        app = _remote_app(fake.base)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.link.state == "ready", "the endpoint's info", 15)
            app.set_samples(2)
            await type_prompt(pilot, "hi")
            await wait_for(pilot, lambda: app.latency.log.request_count == 2 and not app.replies, "both replies", 15)
            assert [b.text for b in assistant_bubbles(app)] == [" w0 w1 w2 w3 w4"] * 2
            assert not any(sev == "error" for sev, _text in app.notices), app.notices
            said = [text for _sev, text in app.notices if "does not support n" in text]
            assert len(said) == 1 and said[0].startswith("endpoint: ")
