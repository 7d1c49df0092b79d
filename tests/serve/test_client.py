"""EndpointClient (EngineProcess's interface over HTTP) against a real `fgchat serve` process, a
stand-in OpenAI server that is not fgchat, nothing at all, and a server killed mid-reply."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from fgchat.client import EndpointClient
from fgchat.client.info import NOT_FGCHAT
from fgchat.protocol.events import EngineError, EngineInfo, ModeChanged, RequestFinished, SamplingParams, TokenEvent
from fgchat.serve.launch import start_server

HI = [{"role": "user", "content": "Hello there!"}]
LONG = SamplingParams(max_tokens=1500, ignore_eos=True)


def _server_args(model) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--max-context", "2048"]


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(_server_args(tiny_llama))
    yield srv
    srv.stop()


def collect(handle, until, timeout: float = 60.0) -> list:
    """Events until until(events) holds (or timeout)."""
    out: list = []
    deadline = time.monotonic() + timeout
    while not until(out) and time.monotonic() < deadline:
        out += handle.get_events(0.05)
    return out


def finished(rids):
    return lambda evs: {e.summary.request_id for e in evs if isinstance(e, RequestFinished)} >= set(rids)


def started(handle) -> EngineInfo:
    handle.start()
    evs = collect(handle, lambda evs: any(isinstance(e, (EngineInfo, EngineError)) for e in evs), 30)
    info = next(e for e in evs if isinstance(e, (EngineInfo, EngineError)))
    assert isinstance(info, EngineInfo), info
    return info


def test_fgchat_server_info_batch_and_timing(server):
    h = EndpointClient(server.base)
    try:
        info = started(h)
        assert h.is_fgchat and info.endpoint == server.base and info.model_name == "llama"
        assert info.available_modes["eager"] == "" and "CUDA" in info.available_modes["full"]
        h.submit_chats(HI, [(1, SamplingParams(max_tokens=6, ignore_eos=True, seed=5)),
                            (2, SamplingParams(max_tokens=6, ignore_eos=True, seed=6))])
        evs = collect(h, finished([1, 2]))
        toks = [e for e in evs if isinstance(e, TokenEvent)]
        sums = {e.summary.request_id: e.summary for e in evs if isinstance(e, RequestFinished)}
        assert sorted(sums) == [1, 2] and all(s.finish_reason == "length" for s in sums.values())
        assert all(s.output_tokens == 6 and s.prompt_tokens > 0 for s in sums.values())
        assert len(toks) == 12 and max(t.batch_size for t in toks) == 2  # one n=2 request: batch 2
        assert all(t.gpu_step_ms is None and t.token_id >= 0 for t in toks)  # CPU: no GPU time
        for rid, s in sums.items():
            mine = [t for t in toks if t.request_id == rid]
            assert [t.token_index for t in mine] == list(range(6))
            assert mine[0].itl_ms is None and all(t.itl_ms > 0 for t in mine[1:])  # measured here
            assert s.text.startswith("".join(t.text for t in mine))
            assert len(s.itl_ms) == 5 and s.ttft_ms > 0
    finally:
        h.shutdown()


def test_cancel_mode_and_request_errors(server):
    h = EndpointClient(server.base)
    try:
        started(h)
        h.submit_chat(7, HI, LONG)
        evs = collect(h, lambda evs: sum(isinstance(e, TokenEvent) for e in evs) >= 3)
        h.cancel(7)
        evs += collect(h, finished([7]), 10)
        end = [e.summary for e in evs if isinstance(e, RequestFinished)]
        assert end[0].finish_reason == "cancelled" and end[0].output_tokens >= 3
        deadline = time.monotonic() + 10
        import httpx

        while httpx.get(f"{server.root}/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{server.root}/health").json()["running"] == 0  # cancelled on the server too

        h.set_mode("full")
        evs = collect(h, lambda evs: any(isinstance(e, ModeChanged) for e in evs), 60)
        mc = next(e for e in evs if isinstance(e, ModeChanged))
        assert mc.mode == "eager" and "full unavailable" in mc.reason

        h.submit_chat(8, [{"role": "user", "content": "hello " * 3000}], SamplingParams(max_tokens=4))
        evs = collect(h, lambda evs: any(isinstance(e, EngineError) for e in evs), 30)
        err = next(e for e in evs if isinstance(e, EngineError))
        assert err.request_id == 8 and not err.fatal and "context" in err.message and not h.failed
    finally:
        h.shutdown()


def test_unreachable_endpoint_is_one_fatal_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    h = EndpointClient(f"http://127.0.0.1:{port}/v1")
    h.start()
    evs = collect(h, lambda evs: bool(evs), 30)
    assert len(evs) == 1 and isinstance(evs[0], EngineError) and evs[0].fatal and "\n" not in evs[0].message
    assert h.failed and not h.is_alive()
    h.shutdown()


def test_server_killed_mid_reply_then_back(tiny_llama):
    srv = start_server(_server_args(tiny_llama))
    port = int(srv.root.rsplit(":", 1)[1])
    h = EndpointClient(srv.base)
    try:
        started(h)
        h.submit_chat(1, HI, LONG)
        evs = collect(h, lambda evs: sum(isinstance(e, TokenEvent) for e in evs) >= 5)
        srv.kill()
        evs += collect(h, finished([1]), 30)
        errors = [e for e in evs if isinstance(e, EngineError)]
        assert len(errors) == 1 and errors[0].request_id == 1 and not errors[0].fatal
        assert "connection lost" in errors[0].message and "\n" not in errors[0].message
        end = next(e.summary for e in evs if isinstance(e, RequestFinished))
        streamed = "".join(e.text for e in evs if isinstance(e, TokenEvent))
        assert end.finish_reason == "error" and end.text == streamed and end.output_tokens >= 5
        assert not h.failed
        srv = start_server(_server_args(tiny_llama), port=port)  # back on the same address
        h.submit_chat(2, HI, SamplingParams(max_tokens=3, ignore_eos=True))
        evs = collect(h, finished([2]))
        assert next(e.summary for e in evs if isinstance(e, RequestFinished)).finish_reason == "length"
    finally:
        h.shutdown()
        srv.stop()


# ---- a server that is OpenAI-compatible but not fgchat -----------------------------------------------

def _plain_openai_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        async def gen():
            head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "plain-model"}
            yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
            for word in ("Hello", " from", " elsewhere"):
                yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"content": word}}]}) + "\n\n"
            yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
            yield "data: " + json.dumps({**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture()
def plain_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_plain_openai_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"  # a bare host: the client adds /v1
    server.should_exit = True
    thread.join(5)
    sock.close()


def test_plain_openai_server_is_not_fgchat(plain_server):
    h = EndpointClient(plain_server)
    try:
        info = started(h)
        assert not h.is_fgchat and info.model_name == "plain-model" and info.endpoint == plain_server + "/v1"
        assert set(info.available_modes.values()) == {NOT_FGCHAT}
        h.set_mode("full")
        evs = collect(h, lambda evs: any(isinstance(e, ModeChanged) for e in evs))
        assert NOT_FGCHAT in next(e for e in evs if isinstance(e, ModeChanged)).reason
        h.submit_chat(1, HI, SamplingParams(max_tokens=10))
        evs = collect(h, finished([1]))
        toks = [e for e in evs if isinstance(e, TokenEvent)]
        assert [t.text for t in toks] == ["Hello", " from", " elsewhere"]
        assert all(t.gpu_step_ms is None and t.launch_ms is None for t in toks)
        s = next(e.summary for e in evs if isinstance(e, RequestFinished))
        assert s.text == "Hello from elsewhere" and s.prompt_tokens == 9 and s.finish_reason == "stop"
    finally:
        h.shutdown()


@pytest.mark.parametrize("argv, needle", [
    (["--endpoint", "ftp://example.org"], "not an http(s) URL"),
    (["--endpoint", "http://127.0.0.1:9/v1", "--device", "cpu"], "--device"),
    (["--endpoint", "http://127.0.0.1:9/v1", "--max-context", "512"], "--max-context"),
])
def test_endpoint_cli_errors_are_one_line(argv, needle, capsys):
    from fgchat.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_base_url_normalisation():
    from fgchat.client.urls import base_url, root_url

    assert base_url("http://h:8000") == "http://h:8000/v1"
    assert base_url(" https://h/v1/ ") == "https://h/v1"
    assert root_url(base_url("http://h:1/v1")) == "http://h:1"
    with pytest.raises(ValueError):
        base_url("http://h:99999/v1")
