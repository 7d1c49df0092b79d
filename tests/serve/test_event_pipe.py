"""The engine child's event pipe: a lagging reader must not stall the engine's step loop."""

from __future__ import annotations

import os
import time

import pytest

from fgchat.engine import event_pipe, serve_loop
from fgchat.engine.core import EngineConfig
from fgchat.engine.process import EngineProcess
from fgchat.engine.serve_loop import serve
from fgchat.protocol.events import EngineInfo, RequestFinished, SamplingParams, TokenEvent


def test_grow_and_unread_on_a_real_pipe():
    r, w = os.pipe()
    try:
        size = event_pipe.grow(w)
        if os.uname().sysname == "Linux":
            with open("/proc/sys/fs/pipe-max-size") as f:
                cap = int(f.read())
            assert size == min(event_pipe.PIPE_BYTES, cap) or size >= event_pipe.PIPE_BYTES
        assert event_pipe.unread(w) == 0
        os.write(w, b"x" * 3000)
        assert event_pipe.unread(w) == 3000 and event_pipe.unread(r) == 3000
        os.read(r, 1000)
        assert event_pipe.unread(w) == 2000
    finally:
        os.close(r)
        os.close(w)


def test_the_backlog_check_says_when_the_reader_lags():
    r, w = os.pipe()
    try:
        check = event_pipe.backlog_check(w)
        assert not check()
        os.write(w, b"x" * (event_pipe.BACKLOG_BYTES + 1))
        assert check()
    finally:
        os.close(r)
        os.close(w)


def _token(rid: int, i: int) -> TokenEvent:
    return TokenEvent(rid, i, i, "a", "full", 1, 0, None, None, i == 0, i)


class _Streaming:
    """Emits one token per step for `n` steps, then one non-token event (a finish stand-in)."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.started = n, 0, False

    def info(self):
        return EngineInfo.__new__(EngineInfo)

    def has_work(self) -> bool:
        return self.i <= self.n

    def step(self) -> list:
        if not self.started:  # serve's first step only reports the mode
            self.started = True
            return []
        if self.i > self.n:
            return []
        self.i += 1
        return [_token(1, self.i - 1)] if self.i <= self.n else ["finished"]


def test_serve_holds_token_events_while_the_reader_lags_and_sends_the_rest_at_once(monkeypatch):
    monkeypatch.setattr(serve_loop, "SEND_INTERVAL_S", 0.0)  # every step's send is due
    eng = _Streaming(10)
    lag = {3, 4, 5, 6}  # steps whose send the reader is behind for
    sent: list[list] = []
    holds: list[int] = []

    def next_command(timeout):
        if timeout is None:
            raise SystemExit  # idle: the stream is over
        return None

    with pytest.raises(SystemExit):
        serve(lambda: eng, next_command, sent.append,
              lagging=lambda: eng.i in lag, on_hold=lambda: holds.append(eng.i))
    tokens = [e for batch in sent for e in batch if isinstance(e, TokenEvent)]
    assert [t.token_index for t in tokens] == list(range(10))  # every token, in order
    assert holds == [3, 4, 5, 6]
    sizes = [sum(isinstance(e, TokenEvent) for e in b) for b in sent if any(isinstance(e, TokenEvent) for e in b)]
    assert sizes == [1, 1, 5, 1, 1, 1]  # steps 3-6 gathered, sent with step 7's token
    assert sent[-1][-1] == "finished"


def test_a_lagging_reader_never_holds_back_a_non_token_event(monkeypatch):
    monkeypatch.setattr(serve_loop, "SEND_INTERVAL_S", 0.0)
    eng = _Streaming(3)
    sent: list[list] = []

    def next_command(timeout):
        if timeout is None:
            raise SystemExit
        return None

    with pytest.raises(SystemExit):
        serve(lambda: eng, next_command, sent.append, lagging=lambda: True)
    # tokens held the whole time; the finish goes out with them as soon as it happens
    assert sent[-1][-1] == "finished" and len([e for e in sent[-1] if isinstance(e, TokenEvent)]) == 3


def test_an_engine_child_keeps_its_pace_while_the_ui_stops_reading(tiny_llama):
    """The UI stops reading for 3 s mid-stream: the child keeps stepping (the gate holds token
    events back) and no token waits on the pipe, where a plain 64 KiB pipe's write would block
    and the next token's ITL would carry the stall."""
    proc = EngineProcess(EngineConfig(model=str(tiny_llama), device="cpu", mode="eager", max_context=2048))
    proc.start()
    try:
        events: list = []
        deadline = time.monotonic() + 120
        while not any(isinstance(e, EngineInfo) for e in events) and time.monotonic() < deadline:
            events += proc.get_events(0.2)
        k, n = 8, 1500
        proc.submit_chats("x", [(i, SamplingParams(max_tokens=n, ignore_eos=True, seed=i)) for i in range(k)])
        while not any(isinstance(e, TokenEvent) for e in events) and time.monotonic() < deadline:
            events += proc.get_events(0.05)
        time.sleep(3.0)  # the UI is busy: nothing read
        while sum(isinstance(e, RequestFinished) for e in events) < k and time.monotonic() < deadline:
            events += proc.get_events(0.2)
    finally:
        proc.shutdown()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == k * n
    worst = max(t.itl_ms for t in tokens if t.itl_ms is not None)
    assert worst < 1000, f"a token waited {worst:.0f} ms"
