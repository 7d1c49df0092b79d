"""A decode step that raises ends the requests the engine holds, each with one line, and the
engine (its process loop) takes new requests afterwards; steps that keep failing stop it."""

from __future__ import annotations

import time

import pytest

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.process import EngineThread
from fgchat.engine.serve_loop import MAX_FAILED_STEPS
from fgchat.protocol.events import EngineError, EngineInfo, RequestFinished, SamplingParams


def collect(handle: EngineThread, until, timeout: float = 60.0) -> list:
    out: list = []
    end = time.monotonic() + timeout
    while time.monotonic() < end and not until(out):
        out += handle.get_events(0.05)
    return out


def finished(out: list, rid: int) -> RequestFinished | None:
    return next((e for e in out if isinstance(e, RequestFinished) and e.summary.request_id == rid), None)


@pytest.fixture
def failing(tiny_llama):
    """An engine thread whose engine's decode launches raise while `fail[0]` > 0."""
    fail = [0]
    holder: list[Engine] = []

    def make() -> Engine:
        eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256))
        launch = eng._launch

        def maybe_failing(*args, **kwargs):
            if fail[0] > 0:
                fail[0] -= 1
                raise ValueError("a step that cannot run")
            return launch(*args, **kwargs)

        eng._launch = maybe_failing
        holder.append(eng)
        return eng

    handle = EngineThread(None, make_engine=make)
    handle.start()
    collect(handle, lambda out: any(isinstance(e, EngineInfo) for e in out))
    yield handle, fail, holder
    handle.shutdown()


def test_a_failed_step_ends_its_requests_with_one_line_and_the_next_request_runs(failing):
    handle, fail, holder = failing
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fail[0] = 1
    for rid, text in ((1, "hello"), (2, "another question")):
        handle.submit_chat(rid, [{"role": "user", "content": text}], params)
    out = collect(handle, lambda out: finished(out, 1) and finished(out, 2))
    for rid in (1, 2):
        assert finished(out, rid).summary.finish_reason == "error"
        errors = [e for e in out if isinstance(e, EngineError) and e.request_id == rid]
        assert len(errors) == 1 and not errors[0].fatal and "a step that cannot run" in errors[0].message
    assert not any(isinstance(e, EngineError) and e.fatal for e in out)
    eng = holder[0]
    assert not eng.has_work() and sorted(eng.scheduler.free_slots) == list(range(8))
    handle.submit_chat(3, [{"role": "user", "content": "hello"}], params)
    out = collect(handle, lambda out: finished(out, 3))
    done = finished(out, 3)
    assert done.summary.finish_reason == "length" and done.summary.output_tokens == 12
    assert not handle.failed


def test_steps_that_keep_failing_stop_the_engine_with_a_fatal_line(failing):
    handle, fail, _ = failing
    fail[0] = 10**6
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    out: list = []
    for rid in range(1, MAX_FAILED_STEPS + 3):
        handle.submit_chat(rid, [{"role": "user", "content": f"question {rid}"}], params)
        out += collect(handle, lambda got: finished(got, rid) or any(isinstance(e, EngineError) and e.fatal
                                                                     for e in got), timeout=30)
        if any(isinstance(e, EngineError) and e.fatal for e in out):
            break
    fatal = [e for e in out if isinstance(e, EngineError) and e.fatal]
    assert len(fatal) == 1 and "a step that cannot run" in fatal[0].message
    assert sum(1 for e in out if isinstance(e, RequestFinished)) == MAX_FAILED_STEPS
