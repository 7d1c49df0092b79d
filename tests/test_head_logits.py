"""The LM head's float32 logits on CPU from half-precision weights (ops.head_logits): exact float32
sums of the rounded inputs, in blocks of rows, every block written."""

import pytest
import torch

from fgchat.engine.model import ops


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_blocked_head_equals_float64_product_of_the_rounded_inputs(monkeypatch, dtype, rows):
    # 7 vocabulary rows per block over penultimate + last partial block: a skipped or misplaced
    # block leaves torch.empty's garbage or another block's values in the output
    monkeypatch.setattr(ops, "HEAD_BLOCK_BYTES", 7 * 4 * 48)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(61, 48, generator=g).to(dtype)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    out = ops.head_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 61)
    exact = x.double() @ w.double().t()
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5)


def test_near_tie_is_not_rounded_to_the_weights_dtype():
    # two logits 0.004 apart near 20: one bf16 value (step 0.125), two float32 values
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
    out = ops.head_logits(x, w)
    assert out[0, 1] - out[0, 0] == pytest.approx(2.0 ** -8)
    assert int(out.argmax()) == 1
