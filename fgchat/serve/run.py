"""Start-up and shutdown of `fgchat serve`.

Order: check the options (a non-loopback host without an API key is refused), bind the socket
(a busy port fails before any model loads), start the engine process and wait for its EngineInfo
(a model that fails to load is one line and exit 2), then run uvicorn until SIGINT/SIGTERM, and
stop the engine. Every failure the user can fix is a FgchatError (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fgchat.protocol.errors import FgchatError

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
        shutdown begins, before uvicorn waits for the open responses to end."""

        before_shutdown: Callable[[], None] | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
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


def run_serve(args: argparse.Namespace, config: Any) -> int:
    key = api_key_for(args)
    if not is_loopback(args.host) and key is None:
        raise FgchatError(f"refusing to listen on {args.host} without an API key: give --api-key KEY "
                          f"(or set {API_KEY_ENV}), or keep the default host 127.0.0.1")
    sock = bind(args.host, args.port)
    try:
        return _serve(sock, args, config, key)
    finally:
        sock.close()


def _serve(sock: socket.socket, args: argparse.Namespace, config: Any, key: str | None) -> int:
    import uvicorn

    from fgchat.serve.app import create_app
    from fgchat.engine.process import EngineProcess
    from fgchat.serve.hub import EngineHub, Unavailable, wait_for_info

    _Server = _server_class()
    handle = EngineProcess(config)
    handle.start()
    hub = None
    try:
        say = lambda text: print(f"fgchat serve: {text}", file=sys.stderr, flush=True)  # noqa: E731
        try:
            info, mode, backlog = wait_for_info(handle, ENGINE_START_TIMEOUT_S, on_phase=say)
        except Unavailable as exc:
            raise FgchatError(f"model failed to load: {exc}") from None
        for note in info.notes:
            say(note)
        hub = EngineHub(handle, info, mode, args.max_queue)
        app = create_app(hub, api_key=key, backlog=backlog)
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=3, lifespan="on"))
        server.before_shutdown = lambda: hub.stop_requests("the server is shutting down")
        say(f"{info.model_name} on {info.device}, mode {mode}; listening on {url_of(sock)}/v1"
            f"{' (API key required)' if key else ''}")
        server.run(sockets=[sock])
    finally:
        if hub is not None:
            hub.close()
        else:
            handle.shutdown()
    return 0
