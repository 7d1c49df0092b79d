"""Deferred graph capture (Tuning.idle_capture): ModeSet's queue, Engine.capture_idle and the
engine loop that runs them while idle. On CPU with stand-in graph runners; the real captures are
the GPU tests' (tests/gpu/test_gpu_graphs.py)."""

from __future__ import annotations

import queue

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.modes.base import StepMode
from fgchat.engine.commands import GetInfo
from fgchat.engine.serve_loop import serve
from fgchat.protocol.events import CaptureReport, EngineInfo, Mode, ModeChanged, SamplingParams


class _Runner(StepMode):
    """A graph mode's stand-in: "captures" by remembering the size and replays eager, except at
    `bad` batch sizes, where its tokens are wrong (a broken graph)."""

    def __init__(self, mode: Mode, program, bad: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.mode, self.program, self.bad = mode, program, bad
        self.captured: list[int] = []

    def has(self, b: int, variant: int) -> bool:
        return b in self.captured

    def capture(self, b: int, variant: int) -> None:
        self.captured.append(b)

    def run(self, b: int, variant: int):
        out = self.program.run_eager(b, variant)
        if b in self.bad:
            out.tokens.add_(1)
        return out

    def drop(self) -> None:
        self.captured.clear()


class _Cap:
    def warm_kernels(self, sizes) -> float:
        return 0.0


class _PrefillGraphs:
    buckets = [32, 64]

    def __init__(self) -> None:
        self.graphs: dict[int, object] = {}
        self.reports: list = []

    def capture_idle(self, n: int) -> None:
        self.graphs[n] = object()


def _engine_with_stand_ins(tiny_llama, bad_full: tuple[int, ...] = ()) -> tuple[Engine, _Runner, _Runner]:
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    for t in eng.cache.k + eng.cache.v:  # the CPU cache starts uninitialized; the self-check
        t.zero_()  # reads rows at random positions, as on CUDA (where the cache starts zeroed)
    ms = eng.modes
    full, piecewise = _Runner(Mode.FULL, eng.program, bad_full), _Runner(Mode.PIECEWISE, eng.program)
    ms.install(Mode.FULL, full)
    ms.install(Mode.PIECEWISE, piecewise)
    ms.cap = _Cap()
    ms.prefill_graphs = _PrefillGraphs()
    return eng, full, piecewise


def test_start_captures_batch_one_of_the_first_mode_and_queues_the_rest(tiny_llama):
    eng, full, piecewise = _engine_with_stand_ins(tiny_llama)
    ms = eng.modes
    ms.capture_start(True, Mode.PIECEWISE)
    assert piecewise.captured == [1] and full.captured == []
    steps = 0
    while ms.capture_next():
        steps += 1
    assert piecewise.captured == list(range(1, 9)) and full.captured == list(range(1, 9))
    assert set(ms.prefill_graphs.graphs) == {32, 64}
    assert steps == 7 + 8 + 2  # one capture per call
    assert not ms.capture_next()


def test_a_size_failing_its_self_check_disables_the_mode_and_skips_its_queue(tiny_llama):
    eng, full, piecewise = _engine_with_stand_ins(tiny_llama, bad_full=(3,))
    ms = eng.modes
    ms.capture_start(True, Mode.FULL)
    eng.set_mode("full")
    assert eng.capture_idle() and eng.capture_idle()  # the two prefill buckets, right after batch 1
    assert set(ms.prefill_graphs.graphs) == {32, 64}
    assert eng.capture_idle() and eng.mode == Mode.FULL  # batch 2
    assert eng.capture_idle()  # batch 3: its replay differs from eager
    assert "self-check mismatch at batch size 3" in ms.unavailable[Mode.FULL]
    assert eng.mode == Mode.EAGER  # the engine left the broken mode
    changed = [e for e in eng.step() if isinstance(e, ModeChanged)]
    assert changed and changed[-1].mode == Mode.EAGER and "batch size 3" in changed[-1].reason
    while eng.capture_idle():
        pass
    assert full.captured == []  # dropped when disabled, the rest of its sizes skipped
    assert piecewise.captured == list(range(1, 9))


def test_no_capture_while_a_request_runs(tiny_llama):
    eng, full, _ = _engine_with_stand_ins(tiny_llama)
    eng.modes.capture_start(False, Mode.FULL)
    eng.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert not eng.capture_idle() and full.captured == [1]
    eng.run_until_done()
    assert eng.capture_idle() and full.captured == [1] and set(eng.modes.prefill_graphs.graphs) == {32}


class _LoopEngine:
    """An engine for the loop alone: `pending` deferred captures, a log of what happened."""

    def __init__(self, pending: int, log: list) -> None:
        self.pending, self.log, self.infos = pending, log, 0

    def info(self):
        self.infos += 1
        return EngineInfo.__new__(EngineInfo)

    def has_work(self) -> bool:
        return False

    def step(self) -> list:
        self.log.append("step")
        return [self.info()] if self.log.count("capture") else []

    def capture_idle(self) -> bool:
        if not self.pending:
            return False
        self.pending -= 1
        self.log.append("capture")
        return True


def test_the_loop_captures_while_idle_takes_commands_first_and_reports_once():
    log: list = []
    eng = _LoopEngine(3, log)
    commands: queue.Queue = queue.Queue()
    commands.put(GetInfo())  # waiting before the first idle pass: applied before any capture
    sent: list[list] = []
    idle_waits = []

    def next_command(timeout):
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            if timeout is None:
                idle_waits.append(len(log))
                if len(idle_waits) > 1:
                    raise SystemExit  # stop the loop: it is blocking while idle with nothing left
            return None
        log.append(type(cmd).__name__)
        return cmd

    try:
        serve(lambda: eng, next_command, sent.append)
    except SystemExit:
        pass
    # startup step; GetInfo applied (its step); three captures; one step whose EngineInfo lists
    # them; then blocking waits only
    assert log == ["step", "GetInfo", "step", "capture", "capture", "capture", "step"], log
    assert sum(isinstance(e, EngineInfo) for batch in sent[-1:] for e in batch) == 1
    assert idle_waits[0] == len(log)


def test_an_engine_without_deferred_captures_keeps_its_idle_loop(tiny_llama):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    assert not eng.capture_idle()  # CPU: nothing queued
    assert not eng.modes.capture_next()


def test_an_idle_prefill_capture_resets_the_inputs_a_longer_prompt_left(tiny_llama, monkeypatch):
    """A bucket captured while idle warms up and records with a prompt of its own size in slot 0:
    the last row index a longer prompt left (40 for a 64-token bucket) would read past a 32-token
    bucket (on the H200: a device-side assert in index_select)."""
    from fgchat.engine.modes.prefill_graphs import PrefillGraphs

    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    graphs = PrefillGraphs(eng.decoder, eng.cache.k, eng.cache.v, cap=None)
    graphs.ids.fill_(7)
    graphs.slot.fill_(3)
    graphs.last.fill_(40)  # what a 41-token prompt run through the 64 bucket leaves
    seen = []
    monkeypatch.setattr(graphs, "capture", lambda b: seen.append(
        (b, graphs.last.item(), graphs.slot.item(), int(graphs.ids[:b].abs().sum()))))
    graphs.capture_idle(32)
    assert seen == [(32, 31, 0, 0)]


def test_the_engine_process_captures_while_idle_unless_told_otherwise(monkeypatch):
    """Idle capture is the engine process's default (its serve loop runs the deferred captures);
    an Engine built directly keeps capturing everything at start."""
    from fgchat.engine.process import engine_process_config
    from fgchat.protocol.tuning import Tuning

    monkeypatch.delenv("FGCHAT_IDLE_CAPTURE", raising=False)
    assert Tuning.from_env().idle_capture is False
    cfg = EngineConfig(model="m", max_context=128)
    assert engine_process_config(cfg).tuning.idle_capture is True
    assert cfg.tuning is None  # the caller's config is not changed
    own = EngineConfig(model="m", tuning=Tuning(idle_capture=False))
    assert engine_process_config(own).tuning.idle_capture is False


def _checked_engine(tiny_llama, monkeypatch, idle: bool) -> Engine:
    """A CPU engine that wants the start-up check (FGCHAT_FAULT=startup-check forces one and makes
    the fast path disagree, so the check also switches the engine to plain torch ops)."""
    from fgchat.protocol.tuning import Tuning

    monkeypatch.setenv("FGCHAT_FAULT", "startup-check")
    return Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128,
                               tuning=Tuning(idle_capture=idle)))


def test_idle_capture_defers_the_startup_check_to_the_first_idle_turn(tiny_llama, monkeypatch):
    eng = _checked_engine(tiny_llama, monkeypatch, idle=True)
    assert eng.startup_check is None and eng.startup_check_pending
    first = eng.info()
    assert first.startup_check is None and first.startup_check_pending
    assert eng.capture_idle()  # the check, before any capture
    assert eng.startup_check is not None and not eng.startup_check.passed and not eng.startup_check_pending
    infos = [e for e in eng.step() if isinstance(e, EngineInfo)]
    assert len(infos) == 1 and infos[0].startup_check is eng.startup_check
    assert not infos[0].startup_check_pending
    assert not eng.capture_idle()  # nothing else deferred on CPU; the check never runs twice


def test_a_request_before_the_idle_turn_runs_the_check_first(tiny_llama, monkeypatch):
    eng = _checked_engine(tiny_llama, monkeypatch, idle=True)
    ran = []
    monkeypatch.setattr(eng.scheduler, "add", lambda *a, _add=eng.scheduler.add, **k: (
        ran.append(eng.startup_check is not None), _add(*a, **k))[1])
    eng.submit([1, 2, 3], SamplingParams(max_tokens=2))
    assert ran == [True]  # the check had run when the request reached the scheduler
    events = eng.run_until_done()
    assert any(isinstance(e, EngineInfo) and e.startup_check is not None for e in events)


def test_without_idle_capture_the_check_runs_while_the_engine_is_built(tiny_llama, monkeypatch):
    eng = _checked_engine(tiny_llama, monkeypatch, idle=False)
    assert eng.startup_check is not None and not eng.startup_check_pending
    assert not eng.capture_idle()


class _GraphRunner(_Runner):
    """A stand-in with GraphMode's bookkeeping: graphs by (size, variant), one report a capture."""

    def __init__(self, mode: Mode, program) -> None:
        super().__init__(mode, program)
        self.graphs: dict = {}
        self.reports: list = []
        self.every: list[int] = []  # every capture's size, drops notwithstanding

    def capture(self, b: int, variant: int) -> None:
        super().capture(b, variant)
        self.every.append(b)
        self.graphs[(b, variant)] = object()
        self.reports.append(CaptureReport(self.mode, b, 0.0, 0.0))

    def drop(self) -> None:
        super().drop()
        self.graphs.clear()


class _CountingPrefillGraphs(_PrefillGraphs):
    def capture_idle(self, n: int) -> None:
        super().capture_idle(n)
        self.reports.append(CaptureReport(Mode.FULL, n, 0.0, 0.0, kind="prefill"))


def _engine_for_recapture(tiny_llama) -> tuple[Engine, _GraphRunner]:
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    ms = eng.modes
    full = _GraphRunner(Mode.FULL, eng.program)
    ms.install(Mode.FULL, full)
    ms.cap = _Cap()
    ms.prefill_graphs = _CountingPrefillGraphs()
    return eng, full


def test_decode_graphs_are_captured_again_while_idle_after_prefill_graphs_came_behind_them(tiny_llama):
    """The engine process's order (decode graphs first, prefill buckets later while idle) leaves
    the decode graphs stale: the idle passes capture each size again, one size a pass, its report
    replaced, once."""
    eng, full = _engine_for_recapture(tiny_llama)
    eng.modes.capture_start(False, Mode.FULL)
    passes = 0
    while eng.capture_idle():
        passes += 1
    # two prefill buckets (queued before the other decode sizes), full 2..8, batch 1 again (it
    # preceded the buckets), the settling
    assert passes == 2 + 7 + 1 + 1
    assert full.every == [*range(1, 9), 1] and sorted(full.graphs) == [(b, 0) for b in range(1, 9)]
    assert sorted(r.batch_size for r in full.reports) == list(range(1, 9))
    assert not eng.modes.decode_stale()
    eng.modes.prefill_graphs.capture_idle(128)  # a later capture on first use (a batch route's)
    for _ in range(3):
        assert eng.capture_idle()
    assert full.every[9:] == [1, 2, 3] and eng.modes.decode_stale()
    eng.modes.prefill_graphs.capture_idle(256)  # another, midway: every size again, from the first
    while eng.capture_idle():
        pass
    assert full.every[12:] == list(range(1, 9)) and not eng.modes.decode_stale()


def test_no_recapture_when_prefill_graphs_came_first(tiny_llama):
    eng, full = _engine_for_recapture(tiny_llama)
    eng.modes.prefill_graphs.capture_idle(32)  # as capture_all: prefill buckets before decode
    eng.modes.capture_sizes(Mode.FULL, range(1, 9), False)
    while eng.capture_idle():
        pass
    assert full.every == list(range(1, 9))
