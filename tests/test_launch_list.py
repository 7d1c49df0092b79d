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


@pytest.mark.parametrize("bad", ["item", "sort", "max_dim"])
def test_unreplayable_ops_leave_no_list(bad):
    x, _ = _inputs(4)
    ops = {
        "item": lambda: x.sum().item(),  # a host sync
        "sort": lambda: torch.sort(x, -1),  # two results
        "max_dim": lambda: torch.max(x, 1),
    }
    with torch.inference_mode():
        result, lst, why = record(ops[bad])
    assert lst is None and why
    assert result is not None  # the step itself still ran


def test_a_step_that_fails_leaves_no_recording_behind():
    def boom():
        torch.zeros(2)
        raise ValueError("step failed")

    with pytest.raises(ValueError):
        record(boom)
    x, w = _inputs(5)
    _, lst, why = record(lambda: F.linear(x, w))  # recording can start again
    assert lst is not None, why
