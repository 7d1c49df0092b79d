"""The engine in its own process (or, for tests and embedding, its own thread).

The UI never runs the engine on its own thread: rendering must not inflate a measured latency.
`EngineProcess` starts a child with the multiprocessing "spawn" context; commands go down a queue,
event batches come back up a one-way pipe, one batch per engine step.

Child loop (`serve`): build the engine (a failure sends `EngineError(fatal=True)` with the one-line
reason and ends the child), send `[EngineInfo, ModeChanged]`, then forever: take commands (block
when the engine is idle, only drain when it has work), apply them, run one `engine.step()`, send
its events as one list. A step that raises ends the requests the engine holds, each with the
one-line error (`Engine.fail_all`), and the loop goes on; it stops (fatal) when the device is
broken or MAX_FAILED_STEPS steps in a row raised. Tokenization and the chat template run in the
child. While idle, an engine with deferred graph captures (`capture_idle`) takes them one at a
time, each after checking for a command, and sends one EngineInfo when they are done.

Invariants:
- Every batch is a list of engine events (TokenEvent, RequestFinished, ModeChanged, EngineError,
  EngineInfo); `get_events` flattens the batches in arrival order.
- A fatal `EngineError` is the last thing a healthy child sends. A child that dies without one
  (killed, crashed) is reported once by the parent as
  `EngineError("engine process exited ...", fatal=True)`, after every batch it did send.
- Nothing here imports Textual, Rich or torch: the UI process imports this module, and the
  child imports torch only once it runs (so a spawn returns at once and the child's imports
  overlap the UI's own start-up).
- With $FGCHAT_STARTUP_TRACE set, both processes append "label<TAB>time.monotonic()" lines to
  that file at each start-up phase (scripts/startup_time.py reads them); unset, nothing is written.
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
from dataclasses import dataclass
from typing import Any

from fgchat.engine import event_pipe
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import (EngineError, EngineInfo, EngineProgress, RequestFinished, RequestNotice,
                                    SamplingParams, TokenEvent)

# ---- commands (parent -> engine); plain dataclasses so they pickle -----------------------------


@dataclass(frozen=True)
class SubmitChat:
    request_id: int
    messages: list[dict[str, str]]
    params: SamplingParams


@dataclass(frozen=True)
class SubmitChats:
    """K replies to one conversation, applied in one go: the messages are tokenized once and all
    K requests are submitted before the next engine step, so they are admitted and prefilled in
    the same round and decode together from their first step (batch K). `messages` as a plain
    string is a raw prompt: encoded as text with the model's BOS, no chat template (as
    `fgchat generate --raw`, and /v1/completions)."""

    messages: list[dict[str, str]] | str
    requests: tuple[tuple[int, SamplingParams], ...]  # (request_id, params) per reply
    # a chat longer than the context loses its oldest turns (engine.chat_fit) and a RequestNotice
    # says so, instead of the request failing (the TUI's chats; the server keeps OpenAI's error)
    fit_context: bool = False


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class SetMode:
    mode: str


@dataclass(frozen=True)
class GetInfo:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


Command = SubmitChat | SubmitChats | Cancel | SetMode | GetInfo | Shutdown

IDLE_POLL_S = 0.5  # how often an idle child checks that its parent still lives
SEND_INTERVAL_S = 0.008  # token events are sent at most this often while generating (~125/s)
COMMAND_POLL_S = 0.002  # commands (stop, mode switch) are picked up within this while busy
MAX_FAILED_STEPS = 3  # steps in a row that raised (each ending its requests) before the engine stops


def _progressed(events: list) -> bool:
    """A step's events show the engine working: a decode step's token, or a request finished
    other than by an error. A call that only prefilled and emitted first tokens does not count
    (on CPU it runs no decode step: a decode that always raises would otherwise never stop the
    engine, each new request's admission clearing the count)."""
    return any((isinstance(e, TokenEvent) and not e.is_first_token)
               or (isinstance(e, RequestFinished) and e.summary.finish_reason != "error") for e in events)


STARTUP_TRACE_ENV = "FGCHAT_STARTUP_TRACE"


def startup_mark(label: str) -> None:
    """Append `label` and the monotonic time (one clock for every process of the machine) to the
    file $FGCHAT_STARTUP_TRACE names; a no-op when it is unset. Never raises."""
    path = os.environ.get(STARTUP_TRACE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{label}\t{time.monotonic():.6f}\n")
    except OSError:
        pass


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


def one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:300]


# ---- the loop that owns the engine -------------------------------------------------------------


# present where an NVIDIA driver is loaded (read without importing torch)
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"


def _captures_graphs(config: Any, driver: str = NVIDIA_DRIVER_FILE) -> bool:
    """Whether the engine will likely run on CUDA (and capture graphs): not asked for the CPU and
    an NVIDIA driver present, judged without importing torch."""
    device = (getattr(config, "device", None) or "auto").strip()
    return device != "cpu" and os.path.exists(driver)


def startup_phase(config: Any, driver: str = NVIDIA_DRIVER_FILE) -> str:
    """What building the engine for `config` will spend its time on, in a few words."""
    graphs = " and capturing graphs" if _captures_graphs(config, driver) else ""
    if getattr(config, "preset", None):
        return "building random weights" + graphs
    from fgchat.engine.model.resolve import pending_conversion

    gguf = pending_conversion(getattr(config, "model", None))
    if gguf is not None:
        return f"converting {gguf.name} (first start only; later starts skip this)"
    return "loading the model" + graphs


def serve(
    make_engine: Callable[[], Any],
    next_command: Callable[[float | None], Command | None],
    send: Callable[[list], None],
    keep_going: Callable[[], bool] = lambda: True,
    phase: str = "",
    lagging: Callable[[], bool] | None = None,
    on_hold: Callable[[], None] | None = None,
) -> None:
    """Own one engine: apply commands, step while there is work, send one event list per step.

    next_command(timeout) returns a command, or None when none arrived within timeout
    (timeout None = wait up to IDLE_POLL_S; 0 = do not wait). keep_going() is asked while idle.
    lagging() says the reader is behind: token events then keep gathering past SEND_INTERVAL_S
    (sent once it catches up, or when the engine runs out of work) instead of a write that could
    wait for the reader; anything but a token event is sent at once regardless. on_hold() is
    called each time that holds a due send back.
    """
    if phase:
        send([EngineProgress(phase)])
    try:
        engine = make_engine()
    except FgchatError as exc:
        send([EngineError(one_line(exc), fatal=True)])
        return
    except Exception as exc:  # anything else while loading is still "the model did not load"
        send([EngineError(f"model failed to load: {type(exc).__name__}: {one_line(exc)}", fatal=True)])
        return
    startup_mark("engine: built")
    first = [engine.info(), *engine.step()]  # step() with no work only returns the initial ModeChanged
    startup_mark("engine: info sent")  # before send: the UI may handle it before a later mark
    send(first)
    batch: list = []  # token events waiting to be sent (coalesced: IPC per step would add latency)
    failed_steps = 0  # steps that raised since the last one that moved a request on (_progressed)
    last_send = last_poll = time.monotonic()
    capture_idle = getattr(engine, "capture_idle", None)
    captured = False  # deferred captures ran since the last EngineInfo
    while True:
        commands: list[Command] = []
        if not engine.has_work():
            if batch:
                send(batch)
                batch = []
            cmd = None
            if capture_idle is not None:  # idle: deferred captures one at a time, a waiting command first
                cmd = next_command(0)
                if cmd is None and capture_idle():
                    captured = True
                    continue
            if captured:  # the last deferred capture is done: EngineInfo lists them all
                captured = False
                send(engine.step())
            if cmd is None:
                cmd = next_command(None)
            if cmd is None:
                if not keep_going():
                    return
                continue
            commands.append(cmd)
        now = time.monotonic()
        if commands or now - last_poll >= COMMAND_POLL_S:
            last_poll = now
            while (cmd := next_command(0)) is not None:
                commands.append(cmd)
        out: list = []
        stop = False
        for cmd in commands:
            if isinstance(cmd, Shutdown):
                stop = True
                break
            out.extend(_apply(engine, cmd))
        if stop:
            if batch or out:
                send([*batch, *out])
            return
        try:
            stepped = engine.step()
            out.extend(stepped)
            if _progressed(stepped):
                failed_steps = 0
        except Exception as exc:
            # the step's requests cannot go on; the engine can, from a clean state, unless the
            # device is broken or steps keep failing (then it stops, and says so)
            message = f"engine step failed: {type(exc).__name__}: {one_line(exc)}"
            failed_steps += 1
            ended = None
            if failed_steps <= MAX_FAILED_STEPS:
                with contextlib.suppress(Exception):  # a broken device: fail_all raises too
                    ended = engine.fail_all(message)
            if ended is None:
                send([*batch, *out, EngineError(message, fatal=True)])
                return
            out.extend(ended)
            send([*batch, *out])
            batch = []
            last_send = time.monotonic()
            continue
        batch.extend(out)
        now = time.monotonic()
        urgent = any(not isinstance(ev, TokenEvent) for ev in out)
        due = now - last_send >= SEND_INTERVAL_S
        if due and not urgent and lagging is not None and engine.has_work() and lagging():
            if on_hold is not None:
                on_hold()
            due = False
        if batch and (urgent or due or not engine.has_work()):
            send(batch)
            batch = []
            last_send = now


def _chat_ids(engine: Any, messages: list[dict[str, str]] | str) -> list[int]:
    if engine.tokenizer is None:
        raise FgchatError("this model has no tokenizer (random weights): chat is unavailable")
    if isinstance(messages, str):
        return engine.tokenizer.encode(messages, add_special_tokens=True)
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _error_event(exc: Exception, request_id: int | None, refused: bool = False) -> EngineError:
    """A command's failure as an event; refused: the request's own input caused it."""
    if isinstance(exc, FgchatError):
        return EngineError(one_line(exc), request_id, refused=refused)
    return EngineError(f"{type(exc).__name__}: {one_line(exc)}", request_id, refused=refused)


def _apply_chats(engine: Any, cmd: SubmitChats) -> list:
    """Tokenize once, submit every request; a failure is one EngineError per request it hits."""
    out: list = []
    try:
        if cmd.fit_context and not isinstance(cmd.messages, str) and engine.tokenizer is not None:
            from fgchat.engine.chat_fit import fit_chat

            reserve = min(max(p.max_tokens for _, p in cmd.requests), engine.max_context // 4)
            ids, dropped = fit_chat(lambda m: _chat_ids(engine, m), cmd.messages, engine.max_context, reserve,
                                    quantum=engine.max_context // 4)
            if dropped:
                out.append(RequestNotice(cmd.requests[0][0], (
                    f"the chat is longer than the model's context ({engine.max_context} tokens): its oldest "
                    f"{dropped} message{'s' if dropped > 1 else ''} left out of this prompt")))
        else:
            ids = _chat_ids(engine, cmd.messages)
    except Exception as exc:  # the messages do not make a prompt (the chat template refused them)
        return [_error_event(exc, rid, refused=True) for rid, _ in cmd.requests]
    for rid, params in cmd.requests:
        try:
            engine.submit(list(ids), params, request_id=rid)
        except Exception as exc:  # a RequestError (FgchatError): the request as sent is refused
            out.append(_error_event(exc, rid, refused=isinstance(exc, FgchatError)))
    return out


def _apply(engine: Any, cmd: Command) -> list:
    """Apply one command; request problems come back as non-fatal EngineError events."""
    if isinstance(cmd, SubmitChat):
        cmd = SubmitChats(cmd.messages, ((cmd.request_id, cmd.params),))
    if isinstance(cmd, SubmitChats):
        return _apply_chats(engine, cmd)
    try:
        if isinstance(cmd, Cancel):
            engine.cancel(cmd.request_id)
        elif isinstance(cmd, SetMode):
            engine.set_mode(cmd.mode)  # its ModeChanged comes out of the next step()
        elif isinstance(cmd, GetInfo):
            return [engine.info()]
    except Exception as exc:
        return [_error_event(exc, getattr(cmd, "request_id", None))]
    return []


# ---- shared parent-side interface ----------------------------------------------------------------


class _EngineHandle:
    """Parent side: send commands, collect event batches, notice a dead engine."""

    fit_context = False  # SubmitChats.fit_context of this handle's chats (the TUI sets it)

    def __init__(self) -> None:
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
        self._send(SubmitChats(prompt, tuple((int(r), p) for r, p in requests), self.fit_context))

    def cancel(self, request_id: int) -> None:
        self._send(Cancel(request_id))

    def set_mode(self, mode: str) -> None:
        self._send(SetMode(mode))

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

    meter = event_pipe.SendMeter()

    @meter.timed
    def send(batch: list) -> None:
        try:
            events.send(batch)
        except (BrokenPipeError, EOFError, OSError):
            meter.report()
            os._exit(0)  # the parent is gone: nobody to report to

    def held() -> None:
        meter.held += 1

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
              phase=startup_phase(config), lagging=event_pipe.backlog_check(events.fileno()), on_hold=held)
    finally:
        meter.report()
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
    the config brings its own tuning or FGCHAT_IDLE_CAPTURE says otherwise."""
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
        self.started_at: float | None = None  # time.monotonic() when start() was called

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


EngineHandle = EngineProcess | EngineThread

__all__ = [
    "Cancel",
    "EngineHandle",
    "EngineInfo",
    "EngineProcess",
    "EngineThread",
    "GetInfo",
    "SetMode",
    "Shutdown",
    "SubmitChat",
    "SubmitChats",
    "serve",
    "startup_mark",
    "terminal_signals_blocked",
]
