"""The loop that owns an engine (`serve`), in the engine's child process or thread.

Build the engine (a failure sends `EngineError(fatal=True)` with the one-line reason and ends the
loop), send `[EngineInfo, ModeChanged]`, then forever: take commands (block when the engine is
idle, only drain when it has work), apply them, run one `engine.step()`, send its events as one
list. A step that raises ends the requests the engine holds, each with the one-line error
(`Engine.fail_all`), and the loop goes on; it stops (fatal) when the device is broken or
MAX_FAILED_STEPS steps in a row raised. Tokenization and the chat template run here. While idle,
an engine with deferred work (`capture_idle`) takes it one piece at a time, each after checking
for a command, and sends one EngineInfo when it is done.

Invariants:
- Every batch sent is a list of engine events (TokenEvent, RequestFinished, ModeChanged,
  EngineError, EngineInfo).
- A fatal `EngineError` is the last thing a healthy loop sends.
- Nothing here imports torch, Textual or Rich; the engine comes from the `make_engine` callable.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from fgchat.engine.commands import (Cancel, Command, GetInfo, SetMode, SetSpeculation, Shutdown, SubmitChat,
                                    SubmitChats)
from fgchat.engine.startup_trace import startup_mark
from fgchat.protocol.errors import FgchatError, error_line
from fgchat.protocol.events import EngineError, EngineProgress, RequestFinished, RequestNotice, TokenEvent

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
        send([EngineError(error_line(exc), fatal=True)])
        return
    except Exception as exc:  # anything else while loading is still "the model did not load"
        send([EngineError(f"model failed to load: {type(exc).__name__}: {error_line(exc)}", fatal=True)])
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
            message = f"engine step failed: {type(exc).__name__}: {error_line(exc)}"
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


def _chat_ids(engine: Any, messages: list[dict[str, str]] | str, enable_thinking: bool | None = None) -> list[int]:
    if engine.tokenizer is None:
        raise FgchatError("this model has no tokenizer (random weights): chat is unavailable")
    if isinstance(messages, str):
        return engine.tokenizer.encode(messages, add_special_tokens=True)
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)


def _error_event(exc: Exception, request_id: int | None, refused: bool = False) -> EngineError:
    """A command's failure as an event; refused: the request's own input caused it."""
    if isinstance(exc, FgchatError):
        return EngineError(error_line(exc), request_id, refused=refused)
    return EngineError(f"{type(exc).__name__}: {error_line(exc)}", request_id, refused=refused)


def _apply_chats(engine: Any, cmd: SubmitChats) -> list:
    """Tokenize once, submit every request; a failure is one EngineError per request it hits."""
    out: list = []
    try:
        if cmd.fit_context and not isinstance(cmd.messages, str) and engine.tokenizer is not None:
            from fgchat.engine.chat_fit import fit_chat

            reserve = min(max(p.max_tokens for _, p in cmd.requests), engine.max_context // 4)
            ids, dropped = fit_chat(lambda m: _chat_ids(engine, m, cmd.enable_thinking), cmd.messages, engine.max_context, reserve,
                                    quantum=engine.max_context // 4)
            if dropped:
                out.append(RequestNotice(cmd.requests[0][0], (
                    f"the chat is longer than the model's context ({engine.max_context} tokens): its oldest "
                    f"{dropped} message{'s' if dropped > 1 else ''} left out of this prompt")))
        else:
            ids = _chat_ids(engine, cmd.messages, cmd.enable_thinking)
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
        elif isinstance(cmd, SetSpeculation):
            engine.set_speculation(cmd.method, cmd.draft_len)
            return [engine.info()]
        elif isinstance(cmd, GetInfo):
            return [engine.info()]
    except Exception as exc:
        return [_error_event(exc, getattr(cmd, "request_id", None))]
    return []
