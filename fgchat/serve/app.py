"""The FastAPI app of `fgchat serve`: OpenAI-compatible routes over one EngineHub.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models(/<name>), GET /health,
GET /metrics (Prometheus), GET /fgchat/info (the engine's EngineInfo as JSON), POST /fgchat/mode.

Invariants:
- Every error is JSON in OpenAI's error shape with a 4xx status for the client's mistakes, 429
  when the engine's queue is full, 503 when the engine stopped; nothing a client sends makes a
  500 or stops the server.
- With an API key, every route but /health needs `Authorization: Bearer <key>`.
- Bodies over max_body bytes are refused (413) before they are read whole.
- A request's engine work is cancelled as soon as its client goes away (before the first token,
  mid-stream, or while a non-streamed reply is being generated).
- Before the first token, before any byte of the stream is sent: a request the engine refused as
  sent (prompt longer than the context, a template failure) is answered as 400, one the engine
  failed (its prefill) as 503.
- An engine error for one choice of several ends that choice alone (finish_reason "error", the
  message in the choice's `error`); the others go on. Only when every choice failed is the
  request an error: a 503, or in a stream one top-level error chunk before usage and [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fgchat.protocol.events import MODES, EngineError
from fgchat.serve.choices import Choices, Delta
from fgchat.serve.errors import ApiError, error_body
from fgchat.serve.hub import Busy, EngineHub, RequestGroup, Unavailable
from fgchat.serve.metrics import CONTENT_TYPE
from fgchat.serve.schemas import (
    MAX_BODY_BYTES,
    ChatRequest,
    CompletionRequest,
    ModeRequest,
    parse_json,
    parse_model,
)
from fgchat.serve.shapes import DONE, Shaper, finite

log = logging.getLogger("fgchat.serve")
DISCONNECT_POLL_S = 0.25
_GONE = object()  # queued by the disconnect watcher


class BearerAuth:
    """ASGI middleware: with a key, every HTTP route but /health needs the Bearer token."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.key is not None and scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                resp = JSONResponse(error_body(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                               code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request, cap: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise ApiError(413, f"request body of {int(length)} bytes is over the limit of {cap} bytes")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > cap:
            raise ApiError(413, f"request body is over the limit of {cap} bytes")
    return bytes(buf)


def create_app(hub: EngineHub, *, api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
               backlog: list | None = None) -> FastAPI:
    """The app; `backlog` holds engine events that arrived before the pump started."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if backlog:
            hub.dispatch(backlog)
        hub.start_pump(asyncio.get_running_loop())
        yield

    app = FastAPI(title="fgchat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)

    def served_name() -> str:
        return hub.info.model_name

    @app.get("/health")
    async def health() -> JSONResponse:
        if hub.failed:
            return JSONResponse(error_body(503, f"engine stopped: {hub.failed}"), status_code=503)
        return JSONResponse({"status": "ok", "model": served_name(), "mode": str(hub.mode),
                             "running": hub.running, "waiting": hub.waiting})

    def check_model(name: str | None) -> None:
        if name is not None and name != served_name():
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{served_name()}'",
                           param="model", code="model_not_found")

    def model_card() -> dict[str, Any]:
        return {"id": served_name(), "object": "model", "created": 0, "owned_by": "fgchat",
                "max_model_len": hub.info.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")  # a hub repo id has a slash
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(hub.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/fgchat/info")
    async def info() -> JSONResponse:
        return JSONResponse(finite(dataclasses.asdict(hub.info)))

    @app.post("/fgchat/mode")
    async def mode(request: Request) -> dict[str, Any]:
        req = parse_model(ModeRequest, parse_json(await read_body(request, max_body)))
        if req.mode not in MODES:
            raise ApiError(400, f"unknown mode '{req.mode}' (choose {', '.join(MODES)})", param="mode")
        try:
            ev = await hub.set_mode(req.mode)
        except Unavailable as exc:
            raise ApiError(503, f"engine stopped: {exc}") from None
        except TimeoutError:
            raise ApiError(503, f"the engine did not switch to {req.mode} in time") from None
        return {"mode": str(ev.mode), "requested": req.mode, "reason": ev.reason}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def _complete(request: Request, chat: bool) -> Response:
        body = parse_json(await read_body(request, max_body))
        req = parse_model(ChatRequest if chat else CompletionRequest, body)
        check_model(req.model)
        messages = req.chat() if chat else req.text()  # a str: a raw prompt (SubmitChats)
        if not (any(m["content"] for m in messages) if chat else messages):
            raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
        stops = req.stops()
        params = req.sampling(hub.info.sampling_defaults)
        try:
            group = hub.submit(messages, params)
        except Busy as exc:
            raise ApiError(429, str(exc), code="queue_full") from None
        except Unavailable as exc:
            raise ApiError(503, f"engine stopped: {exc}") from None
        choices = Choices(req.n, stops, on_stop=lambda i: hub.cancel(group, i))
        shaper = Shaper(chat, served_name())
        handed_over = False
        try:
            pending = await _first_deltas(request, group, choices)
            if pending is None:  # the client went away while the request waited
                return Response(status_code=499)
            if req.stream:
                handed_over = True
                return EngineStream(_stream(group, choices, shaper, pending, req.include_usage()),
                                    on_close=lambda: hub.detach(group))
            if not await _collect(request, group, choices):
                return Response(status_code=499)
            if choices.failure is not None:
                raise ApiError(503, f"generation failed: {choices.failure}")
            return JSONResponse(shaper.whole(choices))
        finally:
            if not handed_over:
                hub.detach(group)

    async def _first_deltas(request: Request, group: RequestGroup, choices: Choices) -> list[Delta] | None:
        """Wait for the request's first event; an engine error then is the client's (400: the
        request was refused as sent) or the engine's (503). None when the client went away
        meanwhile."""
        with _watching(request, group):
            index, ev = await group.queue.get()
        if ev is _GONE:
            return None
        if isinstance(ev, EngineError):
            if ev.refused:
                raise ApiError(400, ev.message)
            raise ApiError(503, f"engine stopped: {ev.message}" if ev.fatal else f"generation failed: {ev.message}")
        return choices.feed(index, ev)

    async def _collect(request: Request, group: RequestGroup, choices: Choices) -> bool:
        """Feed events until every choice is settled (its summary known); False when the client
        went away meanwhile."""
        with _watching(request, group):
            while not choices.settled:
                index, ev = await group.queue.get()
                if ev is _GONE:
                    return False
                choices.feed(index, ev)
        return True

    async def _stream(group: RequestGroup, choices: Choices, shaper: Shaper, pending: list[Delta],
                      usage: bool) -> AsyncIterator[str]:
        failed = False  # the request's error chunk was sent
        while True:
            for d in pending:
                yield shaper.chunk(d)
            if choices.done and not failed and choices.failure is not None:
                failed = True
                yield shaper.error_chunk(choices.failure)
            if choices.settled if usage else choices.done:  # usage: the engine's counts
                break
            index, ev = await group.queue.get()
            pending = choices.feed(index, ev)
        if usage:
            yield shaper.usage_chunk(choices)
        yield DONE

    return app


class EngineStream(StreamingResponse):
    """An SSE response that calls on_close when it ends, however: finished, failed, or cut off
    by a client disconnect (which cancels the streaming task)."""

    def __init__(self, content: AsyncIterator[str], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@contextlib.contextmanager
def _watching(request: Request, group: RequestGroup):
    """While active, a client disconnect puts _GONE on the group's queue."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        group.queue.put_nowait((-1, _GONE))

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        task.cancel()
