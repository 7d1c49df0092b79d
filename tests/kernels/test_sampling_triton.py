"""The unfiltered sampled pick as Triton kernels (kernels.sampling_triton) against the torch
composition of kernels.sampling, which is the reference.

On CPU the kernels run under Triton's interpreter in a subprocess (FGCHAT_TEST_SAMPLING_TRITON=1,
TRITON_INTERPRET=1: the variable must be set before triton loads). On a GPU the same comparison,
bit for bit at real vocabulary sizes and inside a CUDA graph, is tests/gpu/test_gpu_sampling.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from interpreter_rerun import rerun_under_interpreter

from fgchat.engine.kernels import sampling

TRITON = os.environ.get("FGCHAT_TEST_SAMPLING_TRITON") == "1"
inside = pytest.mark.skipif(not TRITON, reason="runs inside test_kernels_under_interpreter")

T = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.7, 0.05])
SEEDS = torch.tensor([1, 8, 15, 2**40 + 3, 22, 29])


def _both(logits: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = logits.shape[0]
    ones, zeros = torch.ones(b), torch.zeros(b, dtype=torch.int64)
    args = (logits, T[:b], ones, zeros, SEEDS[:b], positions)
    return (sampling.sample(*args, filtered=False, use_triton=True),
            sampling.sample(*args, filtered=False, use_triton=False))


@inside
@pytest.mark.parametrize("vocab", [1000, 1024, 3000])  # below, at and across the 1024-id block
def test_the_kernels_pick_the_torch_tokens(vocab):
    g = torch.Generator().manual_seed(vocab)
    for pos in range(12):
        logits = torch.randn(6, vocab, generator=g) * 3
        fast, ref = _both(logits, torch.full((6,), pos) + torch.arange(6))
        assert torch.equal(fast, ref), (pos, fast, ref)
        assert fast[0] == logits[0].argmax()  # T 0: greedy


@inside
def test_ties_go_to_the_first_index_across_blocks():
    logits = torch.full((2, 3000), -1.0)
    logits[:, [2500, 1100, 1500]] = 4.0  # three equal maxima in two blocks
    fast = sampling.sample(logits, torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.int64),
                           SEEDS[:2], torch.tensor([3, 4]), filtered=False, use_triton=True)
    assert fast.tolist() == [1100, 1100]
    assert fast.dtype == torch.int64


@inside
def test_one_lane_and_large_seeds_and_positions():
    logits = torch.randn(1, 2048, generator=torch.Generator().manual_seed(5))
    for pos in (0, 1, 4095, 2**33):
        b = 1
        args = (logits, torch.tensor([1.0]), torch.ones(b), torch.zeros(b, dtype=torch.int64),
                torch.tensor([2**62 + 11]), torch.tensor([pos]))
        assert torch.equal(sampling.sample(*args, filtered=False, use_triton=True),
                           sampling.sample(*args, filtered=False, use_triton=False)), pos


@pytest.mark.skipif(TRITON, reason="this is the parent run")
def test_kernels_under_interpreter():
    """Every test above, through the Triton kernels in Triton's interpreter."""
    rerun_under_interpreter(__file__, "FGCHAT_TEST_SAMPLING_TRITON", "not interpreter", 5)
