"""Start-up and shutdown of `fgchat serve`.

Order: check the options (a non-loopback host without an API key is refused), bind the socket
(a busy port fails before any model loads), start the engine process and wait for its EngineInfo
(a model that fails to load is one line and exit 2), then run uvicorn until SIGINT/SIGTERM, and
stop the engine. Every failure the user can fix is a FgchatError (one line).

Once the socket is bound, SIGINT and SIGTERM end the server with exit status 0 and no traceback or
multiprocessing warning: before the model has loaded they end the engine process at once and say so
in one line on stderr; after it the server stops gracefully (the requests in flight end first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fgchat.protocol.errors import FgchatError
from fgchat.protocol.handle import EngineHandle

ENGINE_START_TIMEOUT_S = 3600.0  # a first start may download and convert a model
API_KEY_ENV = "FGCHAT_API_KEY"


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key_for(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    source = "--api-key" if args.api_key is not None else API_KEY_ENV
    if key is not None and not key.strip():
        raise FgchatError(f"{source} is empty")
    if key is not None and any(ord(c) < 33 or ord(c) > 126 for c in key):
        raise FgchatError(f"{source} must be printable ASCII without spaces")
    return key


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FgchatError(f"cannot listen on {host}: {exc.strerror or exc}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise FgchatError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM end it gracefully and are not raised again
        afterwards (uvicorn re-raises them, which would skip stopping the engine): stopping on a
        signal is a server's normal end, exit status 0. `before_shutdown` runs on the loop as the
        shutdown begins, before uvicorn waits for the open responses to end. A signal `early`
        caught before these handlers took over starts the shutdown at once."""

        before_shutdown: Callable[[], None] | None = None
        early: _StopSignals | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            if self.early is not None and self.early.is_set():
                self.handle_exit(self.early.signum, None)
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if self.before_shutdown is not None:
                self.before_shutdown()
            await super().shutdown(sockets)

    return Server


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopSignals:
    """SIGINT/SIGTERM before uvicorn handles them: the first one's number is kept (`signum`), none
    raises. Installed from the main thread only; a signal ignored on entry stays ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def is_set(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._saved[sig] = signal.signal(sig, self)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._saved.clear()


def _end_loading(handle: EngineHandle, timeout_s: float = 5.0) -> None:
    """End an engine process that is still loading (it holds nothing to finish): SIGTERM, then the
    handle's shutdown once it is gone. No command is sent to it, so no queue feeder thread is
    started that could still be releasing the queue's semaphores when this process exits (the
    resource tracker would then warn of a leaked one)."""
    if handle.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(handle.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while handle.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    handle.shutdown()


def speculation_config(args: argparse.Namespace, config: Any) -> Any:
    """`config` with the --speculate / --draft / --draft-len of `args` (those given)."""
    given = {field: getattr(args, name) for name, field in
             (("speculate", "speculate"), ("draft", "draft"), ("draft_len", "draft_len"))
             if getattr(args, name, None) is not None}
    return dataclasses.replace(config, **given) if given else config


def run_serve(args: argparse.Namespace, config: Any) -> int:
    key = api_key_for(args)
    if not is_loopback(args.host) and key is None:
        raise FgchatError(f"refusing to listen on {args.host} without an API key: give --api-key KEY "
                          f"(or set {API_KEY_ENV}), or keep the default host 127.0.0.1")
    sock = bind(args.host, args.port)
    stop = _StopSignals()
    stop.install()  # before the imports of _serve, which take a while
    try:
        return _serve(sock, args, config, key, stop)
    finally:
        stop.restore()
        sock.close()


def _serve(sock: socket.socket, args: argparse.Namespace, config: Any, key: str | None,
           stop: _StopSignals) -> int:
    import uvicorn

    from fgchat.serve.app import create_app
    from fgchat.engine.process import EngineProcess
    from fgchat.serve.hub import EngineHub, Stopped, Unavailable, wait_for_info

    _Server = _server_class()
    handle = EngineProcess(speculation_config(args, config))
    hub = None
    try:
        handle.start()
        say = lambda text: print(f"fgchat serve: {text}", file=sys.stderr, flush=True)  # noqa: E731
        try:
            info, mode, backlog = wait_for_info(handle, ENGINE_START_TIMEOUT_S, on_phase=say, stopped=stop.is_set)
        except Unavailable as exc:
            raise FgchatError(f"model failed to load: {exc}") from None
        except Stopped:
            _end_loading(handle)
            say(f"stopped by {signal.Signals(stop.signum).name} before the model finished loading")
            return 0
        for note in info.notes:
            say(note)
        hub = EngineHub(handle, info, mode, args.max_queue)
        app = create_app(hub, api_key=key, backlog=backlog)
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=3, lifespan="on"))
        server.before_shutdown = lambda: hub.stop_requests("the server is shutting down")
        server.early = stop
        say(f"{info.model_name} on {info.device}, mode {mode}; listening on {url_of(sock)}/v1"
            f"{' (API key required)' if key else ''}")
        server.run(sockets=[sock])
    finally:
        if hub is not None:
            hub.close()
        else:
            handle.shutdown()
    return 0
