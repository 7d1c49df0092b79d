"""The LM head's float32 logits on CPU from half-precision weights (ops.head_logits, ops.CpuHead):
exact float32 sums of the rounded inputs, whichever way they are computed."""

import pytest
import torch

from fgchat.engine.model import ops


def _inputs(dtype: torch.dtype, rows: int, vocab: int = 61, hidden: int = 48):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    return x, w, x.double() @ w.double().t()


def _check(out: torch.Tensor, exact: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == exact.shape
    # float32 accumulation error of these sums is ~1e-5; a half-rounded output is off by ~1e-2
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_blocked_head_equals_float64_product_of_the_rounded_inputs(monkeypatch, dtype, rows):
    # 7 vocabulary rows per block, the last block partial: a skipped or misplaced block leaves
    # torch.empty's garbage or another block's values in the output
    monkeypatch.setattr(ops, "HEAD_BLOCK_BYTES", 7 * 4 * 48)
    x, w, exact = _inputs(dtype, rows)
    scratch = ops.head_scratch(w)
    assert scratch.shape == (7, 48)
    for out in (ops.head_logits(x, w), ops.blocked_head_logits(x, w, scratch),
                ops.blocked_head_logits(x, w, scratch)):
        _check(out, exact)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 11])
def test_cpu_head_packed_and_unpacked_equal_the_float64_product(monkeypatch, dtype, rows):
    x, w, exact = _inputs(dtype, rows, vocab=1000, hidden=96)
    head = ops.CpuHead(w)
    if head.packed is None:
        pytest.skip("this torch has no oneDNN packed linear")
    assert head.scratch is None
    _check(head(x), exact)
    # a head over the size bound is not packed: the blocked route (half) or F.linear, same sums
    monkeypatch.setattr(ops, "HEAD_PACK_MAX_BYTES", 4 * w.numel() - 1)
    unpacked = ops.CpuHead(w)
    assert unpacked.packed is None and (unpacked.scratch is not None) == (dtype != torch.float32)
    _check(unpacked(x), exact)


def test_cpu_half_head_falls_back_when_packing_fails(monkeypatch):
    def missing(*args):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", missing)
    x, w, exact = _inputs(torch.bfloat16, 3)
    head = ops.CpuHead(w)
    assert head.packed is None
    _check(head(x), exact)


def test_cpu_half_head_falls_back_when_the_packed_product_disagrees(monkeypatch):
    real = torch.ops.mkldnn._linear_pointwise

    def off_by_a_little(*args):
        return real(*args) + 1e-3

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", off_by_a_little)
    x, w, exact = _inputs(torch.bfloat16, 2)
    head = ops.CpuHead(w)
    assert head.packed is None
    _check(head(x), exact)


@pytest.mark.parametrize("route", ["head_logits", "packed", "blocked"])
def test_near_tie_is_not_rounded_to_the_weights_dtype(monkeypatch, route):
    # two logits 2^-8 apart near 20: one bf16 value (step 0.125), two float32 values
    h = 64
    x = torch.zeros(1, h, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    x[0, 1] = 2.0 ** -8
    w = torch.zeros(3, h, dtype=torch.bfloat16)
    w[0, 0] = 20.0
    w[1, 0] = 20.0
    w[1, 1] = 1.0  # row 1: 20 + 2^-8
    rounded = torch.nn.functional.linear(x, w)  # bf16 logits: rows 0 and 1 tie
    assert rounded[0, 0] == rounded[0, 1]
    if route == "blocked":
        monkeypatch.setattr(ops, "HEAD_PACK_MAX_BYTES", 0)
    out = ops.head_logits(x, w) if route == "head_logits" else ops.CpuHead(w)(x)
    assert out[0, 1] - out[0, 0] == pytest.approx(2.0 ** -8)
    assert int(out.argmax()) == 1
