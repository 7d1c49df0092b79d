"""The mode you pick runs (issue 52): a batch size the chosen mode has no graph for is captured at
the step boundary, before the step and outside its timing, and shows up in EngineInfo.captures;
where it cannot be captured the step runs eager and the engine says so (ModeChanged with the
reason, EngineInfo), never a silent substitution. CPU: a stand-in graph mode whose captures are
pending until taken."""

from __future__ import annotations

import time

import pytest

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.modes.eager import EagerMode
from fgchat.protocol.events import CaptureReport, EngineInfo, Mode, ModeChanged, SamplingParams, TokenEvent

CAPTURE_S = 0.5  # a stand-in capture's cost, far above a tiny model's CPU step (~2-60 ms)


class PendingCaptureMode(EagerMode):
    """Full mode on CPU: no batch size is captured until `capture`; `run` refuses an uncaptured
    one. `fail` makes every capture raise as a failed CUDA graph capture does."""

    mode = Mode.FULL

    def __init__(self, engine: Engine, fail: bool = False) -> None:
        super().__init__(engine.program, False, engine.notes.append)
        self.captured: set[tuple[int, int]] = set()
        self.log: list[tuple[str, int]] = []
        self.fail = fail

    def has(self, b: int, variant: int) -> bool:
        return (b, variant) in self.captured

    def capture(self, b: int, variant: int) -> None:
        self.log.append(("capture", b))
        if self.fail:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        time.sleep(CAPTURE_S)
        self.captured.add((b, variant))
        self.reports.append(CaptureReport(Mode.FULL, b, CAPTURE_S, 1.0))

    def run(self, b: int, variant: int):
        assert (b, variant) in self.captured, f"batch size {b} ran without its graph"
        self.log.append(("run", b))
        return super().run(b, variant)


def _engine(tiny_llama, fail: bool = False) -> tuple[Engine, PendingCaptureMode]:
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=128))
    full = PendingCaptureMode(eng, fail)
    eng.modes.install(Mode.FULL, full)
    assert eng.set_mode("full").mode == "full"
    return eng, full


def _k_replies(eng: Engine, k: int = 4, n: int = 6) -> list:
    for i in range(k):
        eng.submit([5, 6, 7 + i], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.7, seed=i))
    return eng.run_until_done()


def test_a_batch_size_without_a_graph_is_captured_before_its_step(tiny_llama):
    eng, full = _engine(tiny_llama)
    events = _k_replies(eng)
    decode = [e for e in events if isinstance(e, TokenEvent) and not e.is_first_token]
    assert decode and all(e.mode == "full" and e.batch_size == 4 for e in decode)
    assert full.log[0] == ("capture", 4) and full.log.count(("capture", 4)) == 1
    assert not any(isinstance(e, ModeChanged) and e.reason for e in events) and eng.mode == "full"
    # the capture is in the panel's captures, and is not timed as the step's launch
    infos = [e for e in events if isinstance(e, EngineInfo)]
    assert infos and any(r.mode == "full" and r.batch_size == 4 for r in infos[-1].captures)
    first_step = min(decode, key=lambda e: e.t_ns)
    assert first_step.launch_ms is not None and first_step.launch_ms < CAPTURE_S * 1e3


def test_a_failed_capture_runs_eager_and_says_why(tiny_llama):
    eng, full = _engine(tiny_llama, fail=True)
    events = _k_replies(eng)
    decode = [e for e in events if isinstance(e, TokenEvent) and not e.is_first_token]
    assert decode and all(e.mode == "eager" for e in decode)
    assert full.log == [("capture", 4)]  # disabled: not retried at every step
    changed = [e for e in events if isinstance(e, ModeChanged) and e.reason]
    assert len(changed) == 1 and changed[0].mode == "eager"
    why = changed[0].reason
    assert "full could not run batch size 4" in why and "graph capture failed" in why and "\n" not in why
    # the event comes before the tokens that ran eager
    assert events.index(changed[0]) < events.index(decode[0])
    info = [e for e in events if isinstance(e, EngineInfo)][-1]
    assert info.mode == "eager" and "graph capture failed" in info.available_modes["full"]
    assert all(r.finish_reason == "length" for r in (e.summary for e in events if type(e).__name__ == "RequestFinished"))


@pytest.mark.parametrize("fail", [False, True])
def test_the_mode_that_ran_is_in_every_reply_summary(tiny_llama, fail):
    eng, _ = _engine(tiny_llama, fail)
    events = _k_replies(eng, k=2, n=4)
    want = {Mode.EAGER: 4} if fail else {Mode.EAGER: 1, Mode.FULL: 3}  # the first token: prefill
    for summary in (e.summary for e in events if type(e).__name__ == "RequestFinished"):
        assert summary.mode_counts == want

