"""Planning the L2 weight prefetch beside attention (CPU; the kernel itself runs in test_gpu_l2_prefetch)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # as test_gemv.py: kernels decorated from here on (pdl's, gemv's) must be the interpreter's
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fgchat.engine.kernels import l2_prefetch as lp  # noqa: E402


def test_plan_takes_whole_tensors_in_order_while_they_fit():
    o = torch.zeros(64, 2048, dtype=torch.bfloat16)  # 256 KiB: 64 chunks
    gu = torch.zeros(256, 2048, dtype=torch.bfloat16)  # 1 MiB: 256 chunks
    down = torch.zeros(16, 2048, dtype=torch.bfloat16)  # 64 KiB
    both = [lp.Range(o.data_ptr(), 64), lp.Range(gu.data_ptr(), 256)]
    assert lp.plan([o, gu], 10 * 2**20) == both
    assert lp.plan([o, gu], (64 + 256) * lp.CHUNK) == both
    # gate/up does not fit whole: the plan ends there, even though down would fit
    assert lp.plan([o, gu, down], 100 * lp.CHUNK) == [lp.Range(o.data_ptr(), 64)]
    assert lp.plan([o, gu], 64 * lp.CHUNK - 1) == []


def test_plan_leaves_out_tails_and_views_but_counts_their_bytes():
    t = torch.zeros(lp.CHUNK * 3 + 100, dtype=torch.uint8)
    assert lp.plan([t], 2**30) == [lp.Range(t.data_ptr(), 3)]  # the 100-byte tail is left out
    strided = torch.zeros(64, 4096, dtype=torch.bfloat16)[:, ::2]
    odd = t[1:]
    assert odd.data_ptr() % 16
    assert lp.plan([strided, odd], 2**30) == []
    # a skipped view still uses its share of the budget
    assert lp.plan([strided, t], strided.numel() * 2 + lp.CHUNK) == []


def test_supported_needs_cuda():
    assert not lp.supported(torch.device("cpu"))
