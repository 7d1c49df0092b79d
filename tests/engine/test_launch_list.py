"""engine.launch_list: a step recorded once and replayed (torch ops on CPU here; Triton launches
and the engine's eager mode are covered by the GPU tests in test_gpu_graphs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fgchat.engine.launch_list import record


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g)


def test_replay_recomputes_from_inputs_changed_in_place():
    x, w = _inputs(0)
    hist = torch.zeros(3)

    def step():
        y = F.linear(x, w)  # functional: re-run, its result copied into y
        y.add_(1.0)  # in place: replayed as called
        scratch = torch.empty(5)  # allocation: nothing to replay
        flat = y.view(-1)  # view of y
        picks = torch.argmax(y, -1)
        acc = torch.zeros(2)
        acc.add_(flat[:2])
        hist.add_(1.0)  # a persistent buffer updated in place every step
        wide = y.to(torch.float64)  # a converting `to` (a view op that copies): re-run too
        del scratch
        return picks, acc, y, wide

    with torch.inference_mode():
        first, lst, why = record(step)
        assert lst is not None, why
        assert lst.result is first
        for seed in (1, 2, 3):
            x.copy_(_inputs(seed)[0])
            got = lst.replay()
            assert got is first  # the recorded tensors, rewritten in place
            snapshot = [t.clone() for t in got]
            want = step()
            for a, b in zip(snapshot, want):
                assert torch.equal(a, b)
    # record ran the step once, the replays three times, the reference steps three times
    assert torch.equal(hist, torch.full((3,), 7.0))


@pytest.mark.parametrize("bad", ["item", "nonzero", "masked_select"])
def test_unreplayable_ops_leave_no_list(bad):
    x, _ = _inputs(4)
    ops = {
        "item": lambda: x.sum().item(),  # a host sync
        "nonzero": lambda: torch.nonzero(x > 0),  # a shape the data decides
        "masked_select": lambda: x.masked_select(x > 0),
    }
    with torch.inference_mode():
        result, lst, why = record(ops[bad])
    assert lst is None and why
    assert result is not None  # the step itself still ran


def test_ops_with_several_results_replay_into_each():
    x, _ = _inputs(6)

    def step():
        values, order = torch.sort(x, -1, descending=True)
        best, where = torch.max(x, 1)
        return values, order, best, where

    with torch.inference_mode():
        first, lst, why = record(step)
        assert lst is not None, why
        for seed in (7, 8):
            x.copy_(_inputs(seed)[0])
            got = [t.clone() for t in lst.replay()]
            for a, b in zip(got, step()):
                assert torch.equal(a, b)
            assert not torch.equal(got[0], first[0].new_zeros(first[0].shape))


@pytest.mark.parametrize("filtered", [True, False])
def test_the_sampling_step_replays_bit_for_bit(filtered):
    """kernels.sampling.sample (the sampled variants' last stage: noise from the seeds; with
    filtering, sort and cumsum) recorded once and replayed over new logits, temperatures and
    seeds."""
    from fgchat.engine.kernels import sampling

    b, v = 4, 50
    logits = torch.zeros(b, v)
    temp, top_p, top_k = torch.zeros(b), torch.zeros(b), torch.zeros(b, dtype=torch.int64)
    seeds, pos = torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)

    def load(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        logits.copy_(torch.randn(b, v, generator=g) * 3)
        temp.copy_(torch.tensor([0.0, 0.7, 1.0, 1.3]))
        top_p.copy_(torch.tensor([1.0, 0.9, 0.5, 1.0]) if filtered else torch.ones(b))
        top_k.copy_(torch.tensor([0, 0, 5, 20]) if filtered else torch.zeros(b, dtype=torch.int64))
        seeds.copy_(torch.randint(0, 2**31, (b,), generator=g))
        pos.copy_(torch.randint(0, 100, (b,), generator=g))

    def step():
        return sampling.sample(logits, temp, top_p, top_k, seeds, pos + 1, filtered=filtered)

    with torch.inference_mode():
        load(0)
        _, lst, why = record(step)
        assert lst is not None, why
        picks = set()
        for seed in (1, 2, 3):
            load(seed)
            got = lst.replay().clone()
            assert torch.equal(got, step())
            assert got[0] == torch.argmax(logits[0])  # temperature 0: greedy
            picks.add(tuple(got.tolist()))
        assert len(picks) > 1  # the replays follow the new inputs


def test_a_step_that_fails_leaves_no_recording_behind():
    def boom():
        torch.zeros(2)
        raise ValueError("step failed")

    with pytest.raises(ValueError):
        record(boom)
    x, w = _inputs(5)
    _, lst, why = record(lambda: F.linear(x, w))  # recording can start again
    assert lst is not None, why


def test_eager_mode_keeps_one_list_per_batch_size_and_variant():
    """EagerMode records the first step of each (batch size, variant) and replays it after; a
    variant that cannot be recorded runs through its own stages every time (not greedy's)."""
    from fgchat.engine.modes.eager import EagerMode
    from fgchat.engine.step import StepOutputs, Variant

    x = torch.zeros(8, 6)
    runs: list[tuple[int, int]] = []

    class Program:
        def run_eager(self, b: int, variant: int) -> StepOutputs:
            runs.append((b, int(variant)))
            logits = x[:b] * 2.0
            if variant == Variant.SAMPLED:
                tokens = torch.sort(logits, -1).indices[:, 0]  # several results: recordable
            elif variant == Variant.PENALIZED:
                tokens = torch.argmax(logits - logits.sum().item(), -1)  # a host sync: not
            else:
                tokens = torch.argmax(logits, -1)
            return StepOutputs(tokens, logits)

    notes: list[str] = []
    mode = EagerMode(Program(), True, notes.append)
    with torch.inference_mode():
        for step in range(3):
            x.copy_(torch.randn(8, 6, generator=torch.Generator().manual_seed(step)))
            for b, variant in ((2, Variant.GREEDY), (2, Variant.SAMPLED), (5, Variant.SAMPLED),
                               (2, Variant.PENALIZED)):
                got = mode.run(b, variant).tokens.clone()
                want = Program().run_eager(b, variant).tokens
                runs.pop()  # the reference run
                assert torch.equal(got, want), (step, b, variant)
    assert set(mode.launch_lists) == {(2, 0), (2, 1), (5, 1), (2, 2)}
    assert mode.launch_lists[(2, Variant.PENALIZED)] is None
    assert len(notes) == 1 and "penalized" in notes[0]
    # recorded steps ran through the stages once; the unrecordable one every time, as itself
    assert runs.count((2, 0)) == 1 and runs.count((2, 1)) == 1 and runs.count((5, 1)) == 1
    assert runs.count((2, 2)) == 3


def test_a_bias_free_linear_replays_as_mm_into_its_result():
    """F.linear without a bias replays as mm.out into the recorded result (no re-run + copy),
    with a bias as the functional call re-run; both give the functional call's bits."""
    x, w = _inputs(9)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(2))

    def step():
        return F.linear(x, w), F.linear(x, w, bias)

    with torch.inference_mode():
        first, lst, why = record(step)
        assert lst is not None, why
        funcs = [c.func for c in lst.calls]
        assert funcs[0] is torch.ops.aten.mm.out and funcs[1] is not torch.ops.aten.mm.out
        for seed in (10, 11):
            x.copy_(_inputs(seed)[0])
            got = [t.clone() for t in lst.replay()]
            want = step()
            assert all(torch.equal(a, b) for a, b in zip(got, want))


FIRST_OP_SCRIPT = """
import sys, torch
from fgchat.engine.launch_list import _OpRecorder
before = set(sys.modules)
with _OpRecorder([]):
    torch.ones(2).add_(1)
print(len(set(sys.modules) - before))
"""


def test_a_recorders_first_op_imports_nothing():
    """TorchDispatchMode's default wraps __torch_dispatch__ so that its first call imports
    torch._dynamo (seconds); the recorder opts out, or the first eager reply's step would pay it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_OP_SCRIPT], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == 0


def test_the_engine_refreezes_its_heap_once_after_the_deferred_captures(monkeypatch):
    from types import SimpleNamespace

    from fgchat.engine import heap
    from fgchat.engine.core import Engine

    calls = []
    monkeypatch.setattr(heap, "freeze_heap", lambda collect=False: calls.append("freeze") or 0)
    eng = SimpleNamespace(_settled=False, modes=SimpleNamespace(cap=object()))
    assert Engine._settle_after_deferred_work(eng) and not Engine._settle_after_deferred_work(eng)
    assert calls == ["freeze"]
    cpu = SimpleNamespace(_settled=False, modes=SimpleNamespace(cap=None))
    assert not Engine._settle_after_deferred_work(cpu) and calls == ["freeze"]
