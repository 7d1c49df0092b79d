"""The engine's handles: the engine in its own process (or, for tests and embedding, its own
thread), driven through commands (engine.commands) and read as event batches.

The UI never runs the engine on its own thread: rendering must not inflate a measured latency.
`EngineProcess` starts a child with the multiprocessing "spawn" context; commands go down a queue,
event batches come back up a one-way pipe, one batch per engine step; the child runs the serving
loop (engine.serve_loop.serve).

Invariants:
- `get_events` flattens the batches in arrival order.
- A child that dies without a fatal EngineError (killed, crashed) is reported once by the parent
  as `EngineError("engine process exited ...", fatal=True)`, after every batch it did send.
- Nothing here imports Textual, Rich or torch: the UI process imports this module, and the
  child imports torch only once it runs (so a spawn returns at once and the child's imports
  overlap the UI's own start-up).
- Both processes mark their start-up phases (engine.startup_trace).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fgchat.engine import event_pipe
from fgchat.engine.commands import (Cancel, Command, GetInfo, SetMode, SetSpeculation, Shutdown, SubmitChat,
                                    SubmitChats)
from fgchat.engine.serve_loop import IDLE_POLL_S, serve, startup_phase
from fgchat.engine.startup_trace import startup_mark
from fgchat.protocol.events import EngineError, SamplingParams
from fgchat.protocol.handle import EngineHandle


@contextlib.contextmanager
def terminal_signals_blocked() -> Iterator[None]:
    """Block SIGHUP and SIGINT in this thread while a child is started: the mask is inherited
    through fork and exec, so the engine child never sees a hangup or a Ctrl-C, not even before
    its entry point runs (it is stopped by the app, or exits when the app is gone; the child may
    be spawned before the UI owns the terminal, while Ctrl-C still sends SIGINT). A signal for
    the app meanwhile is taken by another thread or stays pending until the block ends: never
    lost."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP, signal.SIGINT})
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ---- shared parent-side interface ----------------------------------------------------------------


class _EngineHandle(EngineHandle):
    """Parent side: send commands, collect event batches, notice a dead engine."""

    fit_context = False  # SubmitChats.fit_context of this handle's chats (the TUI sets it)
    enable_thinking: bool | None = None  # SubmitChats.enable_thinking of this handle's chats (a setting)

    def __init__(self) -> None:
        self.started_at: float | None = None  # time.monotonic() when start() was called
        self._fatal_seen = False
        self._exit_reported = False
        self._stopping = False

    # commands
    def submit_chat(self, request_id: int, messages: list[dict[str, str]], params: SamplingParams) -> None:
        self._send(SubmitChat(request_id, [dict(m) for m in messages], params))

    def submit_chats(
        self, messages: list[dict[str, str]] | str, requests: list[tuple[int, SamplingParams]]
    ) -> None:
        """K replies to the same messages (or raw prompt text) as one command: admitted and
        prefilled in one round, so their first decode step runs at batch K (not 1, 2, ... as K
        separate submits would)."""
        prompt = messages if isinstance(messages, str) else [dict(m) for m in messages]
        self._send(SubmitChats(prompt, tuple((int(r), p) for r, p in requests), self.fit_context,
                               self.enable_thinking))

    def cancel(self, request_id: int) -> None:
        self._send(Cancel(request_id))

    def set_mode(self, mode: str) -> None:
        self._send(SetMode(mode))

    def set_speculation(self, method: str, draft_len: int | None = None) -> None:
        self._send(SetSpeculation(method, draft_len))

    def request_info(self) -> None:
        self._send(GetInfo())

    # events
    def get_events(self, timeout: float = 0.1) -> list:
        """Every event that arrived within `timeout` (all batches ready, flattened); may be []."""
        out = self._receive(timeout)
        if any(isinstance(ev, EngineError) and ev.fatal for ev in out):
            self._fatal_seen = True
        if not out and not self._stopping and not self._exit_reported and self._dead():
            self._exit_reported = True
            if not self._fatal_seen:
                out.append(EngineError(self._exit_message(), fatal=True))
        return out

    @property
    def failed(self) -> bool:
        """A fatal error was seen or reported: the engine no longer runs."""
        return self._fatal_seen or self._exit_reported

    # to implement
    def _send(self, cmd: Command) -> None:
        raise NotImplementedError

    def _receive(self, timeout: float) -> list:
        raise NotImplementedError

    def _dead(self) -> bool:
        raise NotImplementedError

    def _exit_message(self) -> str:
        raise NotImplementedError


# ---- the engine in a child process ---------------------------------------------------------------


def _process_main(config: Any, commands: Any, events: Any, log_path: str | None) -> None:
    """Child entry point (spawned): quiet stdio, ignore Ctrl-C (the UI owns it), serve."""
    startup_mark("engine: child started")
    from fgchat.engine.bytecode import use_own_pycache  # before anything imports torch

    if use_own_pycache() is not None:
        startup_mark("engine: own bytecode cache")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_stdio(log_path)
    from fgchat.engine import startup_prime  # the child's only: ctypes stays out of the UI process

    primer = startup_prime.start(getattr(config, "device", None), startup_mark)
    parent = mp.parent_process()

    def next_command(timeout: float | None) -> Command | None:
        try:
            if timeout == 0:
                return commands.get_nowait()
            return commands.get(timeout=IDLE_POLL_S if timeout is None else timeout)
        except queue.Empty:
            return None
        except (EOFError, OSError):
            return Shutdown()

    def send(batch: list) -> None:
        try:
            events.send(batch)
        except (BrokenPipeError, EOFError, OSError):
            os._exit(0)  # the parent is gone: nobody to report to

    def make_engine() -> Any:
        from fgchat.engine.core import Engine
        from fgchat.engine.heap import freeze_heap

        startup_mark("engine: imports done")
        if primer is not None:
            primer.imports_done()
        engine = Engine(engine_process_config(config))
        freeze_heap()  # a later full collection walks only what the serving makes (engine.heap)
        return engine

    try:
        serve(make_engine, next_command, send, keep_going=lambda: parent is None or parent.is_alive(),
              phase=startup_phase(config), lagging=event_pipe.backlog_check(events.fileno()))
    finally:
        try:
            events.close()
        except OSError:
            pass


def _redirect_stdio(log_path: str | None) -> None:
    """Point fd 1 and 2 at log_path (or /dev/null): the terminal belongs to the UI.
    The log is private (it may quote prompts): created 0600, an existing one of the user's is
    stripped of group/other permissions."""
    try:
        if log_path:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                st = os.fstat(fd)
                if st.st_uid == os.getuid() and st.st_mode & 0o077:
                    os.fchmod(fd, st.st_mode & 0o700)
            except OSError:
                pass
        else:
            fd = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def engine_process_config(config: Any) -> Any:
    """`config` as the engine process runs it: captures while idle (Tuning.idle_capture) unless
    the config brings its own tuning."""
    if getattr(config, "tuning", None) is not None:
        return config
    from fgchat.protocol.tuning import Tuning

    return dataclasses.replace(config, tuning=Tuning.from_env(Tuning(idle_capture=True)))


class EngineProcess(_EngineHandle):
    """The engine in a spawned child process.

    Events come through a one-way pipe whose write end only the child holds, so a child that
    dies (even by SIGKILL) shows up as end-of-file here instead of a reader waiting forever.
    """

    def __init__(self, config: Any, log_path: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        # the FGCHAT_* switches read here, so a malformed one is the caller's one-line error
        # (FgchatError) before any child starts; the child inherits the same environment
        self.config = engine_process_config(config)
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self._ctx = mp.get_context("spawn")
        self._commands: Any = None
        self._reader: Any = None
        self._proc: Any = None
        self._eof = False
        self._lock = threading.Lock()  # serialises command sends from several threads

    def start(self) -> None:
        """Spawn the child and return at once: it imports torch and builds the engine on its own,
        then sends EngineInfo (or a fatal EngineError)."""
        if self._proc is not None:
            raise RuntimeError("engine process already started")
        self.started_at = time.monotonic()
        # multiprocessing hands sys.stderr's fd to its helper processes; a UI (Textual) or a test
        # runner may have replaced sys.stderr with an object without a real fd: use the originals.
        saved = sys.stdout, sys.stderr
        if sys.__stdout__ is not None and sys.__stderr__ is not None:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        try:
            self._start()
        finally:
            sys.stdout, sys.stderr = saved
        startup_mark("ui: engine spawned")

    def _start(self) -> None:
        self._commands = self._ctx.Queue()
        self._reader, writer = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(
            target=_process_main,
            args=(self.config, self._commands, writer, self.log_path),
            name="fgchat-engine",
            daemon=True,
        )
        self._proc.start()
        writer.close()  # only the child writes: its death closes the pipe

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def _send(self, cmd: Command) -> None:
        if self._commands is None:
            raise RuntimeError("engine process not started")
        with self._lock:
            try:
                self._commands.put(cmd)
            except (ValueError, OSError):  # queue closed after shutdown
                pass

    def _receive(self, timeout: float) -> list:
        out: list = []
        if self._reader is None or self._eof:
            if timeout > 0:
                threading.Event().wait(min(timeout, 0.05))
            return out
        wait = timeout
        try:
            while self._reader.poll(wait):
                out.extend(self._reader.recv())
                wait = 0
        except (EOFError, OSError):
            self._eof = True
        return out

    def _dead(self) -> bool:
        if self._proc is None:
            return False
        if self._eof and self._proc.exitcode is None:
            self._proc.join(timeout=1.0)  # pipe closed: the child is exiting; fetch its code
        return self._proc.exitcode is not None or self._eof

    def _exit_message(self) -> str:
        code = self._proc.exitcode if self._proc is not None else None
        if code is None:
            return "engine process exited (its event pipe closed)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"engine process exited unexpectedly (killed by {name})"
        return f"engine process exited unexpectedly with code {code}"

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the child to stop; terminate it if it does not within `timeout`. Idempotent."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive():
            self._send(Shutdown())
            proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
        if self._commands is not None:
            self._commands.close()
            self._commands.cancel_join_thread()
        if self._reader is not None:
            try:
                self._reader.close()
            except OSError:
                pass
            self._eof = True


# ---- the engine in a thread (tests, embedding) -----------------------------------------------------


class EngineThread(_EngineHandle):
    """Same interface as EngineProcess, the engine on a daemon thread of this process.

    `make_engine` overrides how the engine is built (default: `Engine(config)`), e.g. for tests
    that need a specially prepared engine.
    """

    def __init__(self, config: Any, make_engine: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.config = config
        self._make_engine = make_engine
        self._commands: queue.Queue[Command] = queue.Queue()
        self._events: queue.Queue[list] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.pid = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine thread already started")
        self.started_at = time.monotonic()

        def make() -> Any:
            if self._make_engine is not None:
                return self._make_engine()
            from fgchat.engine.core import Engine

            return Engine(self.config)

        def next_command(timeout: float | None) -> Command | None:
            try:
                if timeout == 0:
                    return self._commands.get_nowait()
                return self._commands.get(timeout=IDLE_POLL_S if timeout is None else timeout)
            except queue.Empty:
                return None

        self._thread = threading.Thread(
            target=serve, args=(make, next_command, self._events.put),
            kwargs={"phase": "" if self._make_engine is not None else startup_phase(self.config)},
            name="fgchat-engine", daemon=True
        )
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _send(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def _receive(self, timeout: float) -> list:
        out: list = []
        try:
            out.extend(self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait())
            while True:
                out.extend(self._events.get_nowait())
        except queue.Empty:
            pass
        return out

    def _dead(self) -> bool:
        return self._thread is not None and not self._thread.is_alive() and self._events.empty()

    def _exit_message(self) -> str:
        return "engine thread exited unexpectedly"

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(Shutdown())
            self._thread.join(timeout)

