"""A scripted OpenAI-compatible streaming server that is not fgchat, for the endpoint client's
tests (and the TUI's and the bench's over it): `FakeServer(script)` runs it on a free localhost
port in a thread; `script` picks what /v1/chat/completions streams:

- "n": honours `n`; each choice streams `tokens` words then finish_reason "length".
- "early": honours `n`; choice 0 says finish_reason "stop" after 3 words while the others go on
  for `tokens` words (the finish arrives mid-stream, as vLLM and fgchat send it).
- "ignore_n": answers one choice whatever `n` asks (llama-cpp-python's server does).
- "cut_on_arrival": a stream still running when another request arrives is cut without a
  finish_reason (llama-cpp-python cancels a stream when a new request comes, by default).
- "llama_cpp": both of the last two, as llama-cpp-python's server behaves by default.

Every request body is kept in `bodies`, in arrival order.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

MODEL = "fake-model"
STEP_S = 0.03  # between two streamed steps


def _event(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


class FakeServer:
    def __init__(self, script: str, tokens: int = 12) -> None:
        self.script = script
        self.tokens = tokens
        self.bodies: list[dict[str, Any]] = []
        self._cut: list[asyncio.Event] = []  # one per stream still running ("cut_on_arrival")
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(5)
        self._sock.close()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)
            for ev in self._cut:  # a new request cuts the streams still running
                if self.script in ("cut_on_arrival", "llama_cpp"):
                    ev.set()
            cut = asyncio.Event()
            self._cut.append(cut)
            n = 1 if self.script in ("ignore_n", "llama_cpp") else int(body.get("n") or 1)
            return StreamingResponse(self._stream(n, int(body.get("max_tokens") or self.tokens), cut),
                                     media_type="text/event-stream")

        return app

    async def _stream(self, n: int, max_tokens: int, cut: asyncio.Event):
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
        tokens = min(self.tokens, max_tokens)
        try:
            yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}
                                              for i in range(n)]})
            for step in range(tokens):
                await asyncio.sleep(STEP_S)
                if cut.is_set():
                    return  # the connection ends without a finish_reason
                choices = []
                for i in range(n):
                    words = 3 if (self.script == "early" and i == 0) else tokens
                    if step < words:
                        choices.append({"index": i, "delta": {"content": f" w{step}"}, "finish_reason": None})
                    elif step == words:
                        choices.append({"index": i, "delta": {}, "finish_reason": "stop"})
                yield _event({**head, "choices": choices})
            yield _event({**head, "choices": [{"index": i, "delta": {}, "finish_reason": "length"}
                                              for i in range(n) if not (self.script == "early" and i == 0)]})
            yield _event({**head, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens * n}})
            yield "data: [DONE]\n\n"
        finally:
            self._cut.remove(cut)
