"""The TUI as a client of a real `fgchat serve` (issue 20): a reply streams from the server into
the chat with timings measured at the client and the server's own mode availability; a server
killed mid-reply leaves the partial reply and an error while the app keeps going."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from fgchat.client.handle import EndpointClient  # noqa: E402
from fgchat.engine.core import EngineConfig  # noqa: E402
from fgchat.protocol.events import SamplingParams  # noqa: E402
from fgchat.serve.launch import start_server  # noqa: E402
from fgchat.tui.app import FgchatApp  # noqa: E402
from test_tui import SIZE, data_dir, type_prompt, wait_for  # noqa: E402, F401


@pytest.fixture()
def server(tiny_llama):
    srv = start_server(["--model", str(tiny_llama), "--device", "cpu", "--max-context", "1024"])
    yield srv
    srv.kill()


def make_app(server, max_tokens: int) -> FgchatApp:
    return FgchatApp(EngineConfig(model=None), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                     engine_factory=lambda cfg: EndpointClient(server.base))


async def test_tui_streams_from_a_running_server(server, data_dir):
    app = make_app(server, max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.link.state != "starting", "the endpoint's info", 60)
        assert app.link.state == "ready", app.link.error
        assert app.link.info.endpoint.startswith(server.root)
        await type_prompt(pilot, "Hello there!")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1, "the reply", 60)
        (req,) = app.latency.log.requests()
        assert req.output_tokens == 12 and req.finish_reason == "length"
        tokens = list(app.latency.log.tokens())
        assert len(tokens) == 12 and all(t.endpoint for t in tokens)
        assert all(t.itl_ms is not None and t.itl_ms >= 0 for t in tokens[1:])
        # an fgchat server reports its own modes and why they are off (a CPU server: no graphs),
        # not the "not an fgchat server" of other endpoints
        modes = app.link.info.available_modes
        assert modes.get("eager") == "" and "CUDA" in modes.get("full", ""), modes


async def test_server_killed_mid_reply_keeps_the_partial_reply(server, data_dir):
    app = make_app(server, max_tokens=1500)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.link.state != "starting", "the endpoint's info", 60)
        await type_prompt(pilot, "Tell me a long story")
        await wait_for(pilot, lambda: app.latency.log.token_count >= 5, "some tokens", 60)
        server.kill()
        await wait_for(pilot, lambda: not app.replies, "the reply to end", 60)
        (req,) = app.latency.log.requests()
        assert req.finish_reason == "error" and req.output_tokens >= 5
        assert any(sev == "error" for sev, _ in app.notices) or app.link.error
        assert app.is_running
