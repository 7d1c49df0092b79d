"""Planning the L2 weight prefetch beside attention (CPU; the kernel itself runs in test_gpu_l2_prefetch)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fgchat.engine import l2_prefetch as lp  # noqa: E402


def test_plan_takes_tensors_in_order_up_to_the_budget():
    o = torch.zeros(64, 2048, dtype=torch.bfloat16)  # 256 KiB: 64 chunks
    gu = torch.zeros(256, 2048, dtype=torch.bfloat16)  # 1 MiB: 256 chunks
    whole = lp.plan([o, gu], 10 * 2**20)
    assert whole == [lp.Range(o.data_ptr(), 64), lp.Range(gu.data_ptr(), 256)]
    part = lp.plan([o, gu], 100 * lp.CHUNK + 5)  # a partial chunk of budget is not requested
    assert part == [lp.Range(o.data_ptr(), 64), lp.Range(gu.data_ptr(), 36)]
    assert lp.plan([o, gu], 10 * lp.CHUNK) == [lp.Range(o.data_ptr(), 10)]
    assert lp.plan([o, gu], lp.CHUNK - 1) == []


def test_plan_leaves_out_tails_views_and_misaligned_starts():
    t = torch.zeros(lp.CHUNK * 3 + 100, dtype=torch.uint8)
    assert lp.plan([t], 2**30) == [lp.Range(t.data_ptr(), 3)]  # the 100-byte tail is left out
    strided = torch.zeros(64, 4096, dtype=torch.bfloat16)[:, ::2]
    assert lp.plan([strided], 2**30) == []
    odd = t[1:]
    assert odd.data_ptr() % 16 and lp.plan([odd], 2**30) == []


def test_at_most_two_ranges_per_launch():
    with pytest.raises(ValueError):
        lp.issue([lp.Range(0, 1)] * 3)


def test_supported_needs_cuda():
    assert not lp.supported(torch.device("cpu"))
