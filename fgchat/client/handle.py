"""EndpointClient: EngineProcess's interface over an OpenAI-compatible streaming server (httpx).

start() asks the server for its model (/v1/models) and, if it is fgchat, its EngineInfo
(/fgchat/info); then each submit streams one /chat/completions request (K replies to the same
messages with consecutive seeds go as one request with n=K, so a batching server decodes them
together) on its own thread, and get_events returns the TokenEvent / RequestFinished /
EngineError events those threads made, in arrival order.

A server that ignores `n` (it answers fewer choices than asked, e.g. llama-cpp-python's) is found
out at the end of such a stream: the replies it left out go again as one request each, one
RequestNotice says so, and every later K replies go as K requests one after another
(`single_choice`; such servers serve one stream at a time).

Invariants:
- Only a failed start (server unreachable, key refused, model not served) is fatal; a server
  that goes away mid-reply fails that reply alone (EngineError, then RequestFinished("error")
  with the partial text) and the next request connects again. A choice the server ends with
  finish_reason "error" (its message in the choice's `error`) fails the same way, alone.
- cancel(rid) ends that reply at once (RequestFinished "cancelled", partial text kept); once all
  replies of a request are cancelled its connection is closed, which cancels it on the server.
- Control calls (start, set_mode, request_info) run in order on one control thread.
- Nothing here imports torch, Textual or the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from fgchat.client.info import NOT_FGCHAT, info_from_json, stand_in_info
from fgchat.client.sse import sse_data
from fgchat.client.stream import RemoteRequest
from fgchat.client.urls import base_url, root_url
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import (
    REMOTE_MODE,
    EngineError,
    EngineInfo,
    Mode,
    ModeChanged,
    RequestNotice,
    SamplingParams,
)
from fgchat.protocol.handle import EngineHandle
from fgchat.stdio import one_line

API_KEY_ENV = "FGCHAT_API_KEY"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a queued request may wait long for its first token
MODE_TIMEOUT_S = 180.0
MAX_ERROR_BODY = 4096


class EndpointClient(EngineHandle):
    """The engine handle of a server at `url` (protocol.handle.EngineHandle)."""

    fit_context = False  # the server keeps its own policy for a chat longer than the context

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 *, read_timeout: float = READ_TIMEOUT_S) -> None:
        self.base = base_url(url)
        self.root = root_url(self.base)
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.read_timeout = read_timeout
        self.info: EngineInfo | None = None
        self.is_fgchat = False
        self.single_choice = False  # the server ignores `n`: K replies go as K requests
        self.pid = None  # no local process
        self.started_at: float | None = None
        self._pending: list = []  # events not yet taken by get_events
        self._ready = threading.Condition()
        self._control: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._requests: dict[int, RemoteRequest] = {}
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._thread: threading.Thread | None = None
        self._fatal = False
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("endpoint client already started")
        self.started_at = time.monotonic()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(self.read_timeout, connect=CONNECT_TIMEOUT_S),
                                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
        self._thread = threading.Thread(target=self._control_loop, name="fgchat-endpoint", daemon=True)
        self._thread.start()
        self._control.put(self._hello)

    def is_alive(self) -> bool:
        return self._thread is not None and not self._stopping and not self._fatal

    @property
    def failed(self) -> bool:
        return self._fatal

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel every reply in flight and close the connections. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            with req.lock:
                for c in req.choices:
                    req.end(c.rid, "cancelled")
        self._control.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._client is not None:
            self._client.close()

    # ---- commands -------------------------------------------------------------------------------
    def submit_chat(self, request_id: int, messages: list[dict[str, str]], params: SamplingParams) -> None:
        self.submit_chats(messages, [(request_id, params)])

    def submit_chats(self, messages: list[dict[str, str]] | str,
                     requests: list[tuple[int, SamplingParams]]) -> None:
        if isinstance(messages, str):
            raise FgchatError("an endpoint takes chat messages, not a raw prompt")
        msgs = [dict(m) for m in messages]
        if self.single_choice:  # one request per reply, one after another
            self._send(msgs, [[r] for r in requests])
            return
        for group in _batches(list(requests)):
            self._send(msgs, [group])

    def _send(self, messages: list[dict[str, str]], groups: list[list[tuple[int, SamplingParams]]]) -> None:
        """One streamed request per group (n = its length), the groups one after another on one
        thread; a group whose replies were all cancelled while it waited is not sent."""
        queued = []
        with self._lock:
            for group in groups:
                req = RemoteRequest([rid for rid, _ in group], self.info.mode if self.info else REMOTE_MODE)
                for rid, _ in group:
                    self._requests[rid] = req
                queued.append((req, group))

        def run() -> None:
            for req, group in queued:
                if req.all_ended:
                    self._end(req, [])
                else:
                    self._stream(req, messages, group)

        threading.Thread(target=run, name="fgchat-endpoint-stream", daemon=True).start()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            return
        with req.lock:
            events = req.end(request_id, "cancelled")
        self._put(events)

    def set_mode(self, mode: str) -> None:
        self._control.put(lambda: self._set_mode(str(mode)))

    def set_speculation(self, method: str, draft_len: int | None = None) -> None:
        raise FgchatError("speculation runs in the local engine, not through an endpoint")

    def request_info(self) -> None:
        self._control.put(self._refresh_info)

    # ---- events ---------------------------------------------------------------------------------
    def get_events(self, timeout: float = 0.1) -> list:
        """Every event made so far, waiting up to `timeout` for one; may be []."""
        with self._ready:
            if not self._pending and timeout > 0:
                self._ready.wait(timeout)
            out, self._pending = self._pending, []
        return out

    def _put(self, events: list) -> None:
        if events:
            with self._ready:
                self._pending.extend(events)
                self._ready.notify_all()

    # ---- control thread -------------------------------------------------------------------------
    def _control_loop(self) -> None:
        while (task := self._control.get()) is not None:
            try:
                task()
            except Exception as exc:  # a control call never kills the handle
                self._put([EngineError(f"{self.base}: {_why(exc)}")])

    def _get(self, url: str) -> httpx.Response:
        assert self._client is not None
        return self._client.get(url, timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S))

    def _hello(self) -> None:
        try:
            resp = self._get(f"{self.base}/models")
            if resp.status_code != 200:
                raise _Refused(f"{self.base}/models answered HTTP {resp.status_code}: {_error_text(resp)}")
            served = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
        except (httpx.HTTPError, ValueError, AttributeError, _Refused) as exc:
            self._fatal = True
            self._put([EngineError(f"cannot use {self.base}: {_why(exc)}", fatal=True)])
            return
        if self.model is None:
            if not served:
                self._fatal = True
                self._put([EngineError(f"{self.base} serves no model", fatal=True)])
                return
            self.model = str(served[0])
        elif served and self.model not in served:
            self._fatal = True
            self._put([EngineError(f"{self.base} does not serve {self.model!r} (it serves: "
                                   f"{', '.join(map(str, served))})", fatal=True)])
            return
        info = self._fgchat_info() or stand_in_info(self.model, self.base, _max_len(resp, self.model))
        self.info = info
        self._put([info, ModeChanged(info.mode)])

    def _fgchat_info(self) -> EngineInfo | None:
        try:
            resp = self._get(f"{self.root}/fgchat/info")
            if resp.status_code != 200:
                return None
            info = info_from_json(resp.json(), self.base)
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None
        self.is_fgchat = True
        return info

    def _refresh_info(self) -> None:
        if self.info is None:
            return
        if self.is_fgchat:
            self.info = self._fgchat_info() or self.info
        self._put([self.info])

    def _set_mode(self, mode: str) -> None:
        if self.info is None:
            return
        if not self.is_fgchat:  # it runs as it runs: asking for that is no change
            why = "" if mode == self.info.mode else f"{mode} unavailable: {NOT_FGCHAT}"
            self._put([ModeChanged(self.info.mode, why)])
            return
        assert self._client is not None
        resp = self._client.post(f"{self.root}/fgchat/mode", json={"mode": mode},
                                 timeout=httpx.Timeout(MODE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        if resp.status_code != 200:
            self._put([EngineError(f"mode switch refused (HTTP {resp.status_code}): {_error_text(resp)}")])
            return
        data = resp.json()
        ev = ModeChanged(Mode(data["mode"]), str(data.get("reason") or ""))
        self.info = self._fgchat_info() or dataclasses.replace(self.info, mode=ev.mode)
        self._put([ev, self.info])

    # ---- one streamed request (its own thread) --------------------------------------------------
    def _stream(self, req: RemoteRequest, messages: list[dict[str, str]],
                group: list[tuple[int, SamplingParams]]) -> None:
        n = len(group)
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **sampling_body(group[0][1])}
        if n > 1:
            body["n"] = n
        try:
            assert self._client is not None
            with self._client.stream("POST", f"{self.base}/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self._end(req, req.fail_all(f"HTTP {resp.status_code}: {_error_text(resp)}"))
                    return
                for data in sse_data(resp.iter_lines()):
                    if data.strip() == "[DONE]":
                        break
                    self._chunk(req, json.loads(data))
                    if req.all_ended:  # every reply cancelled: closing the connection cancels it there
                        break
            with req.lock:  # held while the left-out replies move: a cancel finds one request or the other
                unanswered = req.take_unanswered()
                if unanswered:
                    self._answer_apart(messages, [r for r in group if r[0] in unanswered], n)
                events = req.end_all()
            self._end(req, events)
        except (httpx.HTTPError, ValueError, AttributeError, RuntimeError) as exc:
            with req.lock:
                events = req.fail_all(f"{self.base}: connection lost mid-reply ({_why(exc)})")
            self._end(req, events)

    def _answer_apart(self, messages: list[dict[str, str]], left: list[tuple[int, SamplingParams]], n: int) -> None:
        """The server answered fewer than the `n` choices asked for: it ignores `n`. The replies
        it left out go again as one request each, one after another, and so do all later ones (such
        a server serves one stream at a time: llama-cpp-python's cuts a stream when another comes)."""
        first = not self.single_choice
        self.single_choice = True
        if first:
            self._put([RequestNotice(left[0][0], (
                f"{self.base} answered {n - len(left)} of the {n} replies asked for in one request (it "
                f"does not support n): each reply now goes as its own request"), title="endpoint")])
        self._send(messages, [[r] for r in left])

    def _chunk(self, req: RemoteRequest, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        ext = obj.get("fgchat") if isinstance(obj.get("fgchat"), dict) else None
        events: list = []
        with req.lock:
            if "error" in obj:  # the request failed as a whole (one choice's error is in the choice)
                events += req.fail_all(f"server error: {_error_message(obj['error'])}")
            if isinstance(obj.get("usage"), dict):
                req.usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if not isinstance(ch, dict):
                    continue
                index = int(ch.get("index", 0))
                req.seen(index)
                delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
                text = delta.get("content") if "delta" in ch else ch.get("text")
                token_ext = ext if (self.is_fgchat and ext and "token_index" in ext) else None
                if self.is_fgchat and token_ext is None:
                    if text and 0 <= index < len(req.choices):
                        req.choices[index].parts.append(str(text))  # a tail: text, not a token
                else:
                    events += req.token(index, str(text or ""), token_ext, self._in_flight())
                if ch.get("finish_reason") == "error" or ch.get("error"):  # this choice alone failed
                    if 0 <= index < len(req.choices):
                        message = _error_message(ch.get("error") or "the server ended the reply with an error")
                        events += req.fail(req.choices[index].rid, f"server error: {message}")
                elif ch.get("finish_reason"):
                    events += req.finished(index, str(ch["finish_reason"]))
        self._put(events)

    def _end(self, req: RemoteRequest, events: list) -> None:
        self._put(events)
        with self._lock:
            for c in req.choices:
                if self._requests.get(c.rid) is req:
                    del self._requests[c.rid]

    def _in_flight(self) -> int:
        with self._lock:
            return max(1, sum(r.live() for r in {id(r): r for r in self._requests.values()}.values()))


def _error_message(err: Any) -> str:
    """One line from an OpenAI error object (or whatever a server put in its place)."""
    return one_line(str(err.get("message") if isinstance(err, dict) else err))


class _Refused(Exception):
    pass


def sampling_body(p: SamplingParams) -> dict[str, Any]:
    """The request fields for p; fields at their "off" value are left out (OpenAI itself knows no
    top_k, repetition_penalty or ignore_eos; vLLM and fgchat do)."""
    body: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_tokens,
                            "seed": p.seed}
    if p.top_k > 0:
        body["top_k"] = p.top_k
    if p.repetition_penalty != 1.0:
        body["repetition_penalty"] = p.repetition_penalty
    if p.presence_penalty:
        body["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        body["frequency_penalty"] = p.frequency_penalty
    if p.ignore_eos:
        body["ignore_eos"] = True
    return body


def _batches(requests: list[tuple[int, SamplingParams]]) -> list[list[tuple[int, SamplingParams]]]:
    """All requests as one n=K request when they differ only in consecutive seeds; else one each."""
    if len(requests) > 1:
        first = requests[0][1]
        if all(p == dataclasses.replace(first, seed=first.seed + i) for i, (_, p) in enumerate(requests)):
            return [requests]
    return [[r] for r in requests]


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, _Refused):
        return one_line(text)
    return one_line(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _error_text(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return one_line(str(err["message"]))
        if isinstance(data, dict) and data.get("detail"):
            return one_line(str(data["detail"]))
    except (ValueError, AttributeError):
        pass
    return one_line(resp.text[:MAX_ERROR_BODY]) or resp.reason_phrase


def _max_len(resp: httpx.Response, model: str) -> int:
    try:
        for m in resp.json().get("data", []):
            if m.get("id") == model and isinstance(m.get("max_model_len"), int):
                return int(m["max_model_len"])
    except (ValueError, AttributeError):
        pass
    return 0


def endpoint_factory(url: str, model: str | None = None, api_key: str | None = None) -> Callable[..., EndpointClient]:
    """An engine factory for FgchatApp: `factory(config, **ignored)` -> a new EndpointClient."""

    def make(config: Any = None, **_: Any) -> EndpointClient:
        return EndpointClient(url, model=model, api_key=api_key)

    return make
