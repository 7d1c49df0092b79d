"""The prefill GEMM on quantized weights (kernels.qgemm), Triton's interpreter on CPU, against the
float64 product of x with the weights qtiles.dequantize writes in bf16 (the values prefill used
through a dequantized copy), on rows with massive-activation channels; masked row and column
edges, grouped program order, a stack's parts in their columns, the bias. GPU runs at the 1B
shapes with timings: tests/gpu/test_gpu_qgemv.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

import interpreter_rounding  # noqa: E402
from qweights import bound, outlier_rows, random_qweight  # noqa: E402

from fgchat.engine.kernels import qgemm, qgemv, qtiles  # noqa: E402
from fgchat.engine.quant.qweight import QuantStack, stack_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RNE = interpreter_rounding.install()
pytestmark = pytest.mark.skipif(not RNE and DEV == "cpu", reason="bf16 needs the interpreter's RNE patch")
BF16_ULP = 2.0**-7
# small tiles keep the interpreter quick and give several row and column tiles at small shapes
SMALL = qgemm.GemmConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, group_m=2)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return outlier_rows(m, k, seed).to(torch.bfloat16).to(DEV)


def _check(x: torch.Tensor, w, got: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Asserts got within the float32-sum bound of x @ dequantize(w, bf16)^T (+ bias) in float64;
    returns the reference."""
    wq = qtiles.dequantize(w, torch.bfloat16).double().cpu()
    ref = x.double().cpu() @ wq.t()
    if bias is not None:
        ref = ref + bias.double().cpu()
    err = (got.double().cpu() - ref).abs()
    lim = bound(x.cpu(), wq.abs(), ref, BF16_ULP)
    assert (err <= lim).all(), f"{w.fmt}: worst error / bound {(err / lim).max().item():.3g}"
    return ref


@pytest.mark.parametrize("fmt,m,n,k", [("int4", 40, 80, 256), ("fp8", 17, 64, 512), ("Q4_K", 40, 48, 512),
                                       ("Q6_K", 17, 80, 256), ("Q4_1", 40, 72, 256)])
def test_gemm_matches_float64_of_the_dequantized_weights(fmt, m, n, k):
    """Rows and columns past the tiles' edges (M 17 / 40 and N 48 / 72 / 80 on 32-wide tiles)."""
    w = random_qweight(fmt, n, k, seed=len(fmt) + n, device=DEV)
    x = _x(m, k, 1)
    ref = _check(x, w, qgemm.gemm(x, w, config=SMALL))
    # the bound sees a weight in the wrong place: a low-half column swapped with its high half's
    pair = qtiles.NIBBLE_PAIR.get(fmt, qtiles.pick_block_k(fmt, k, 128) // 2)
    wrong = qtiles.dequantize(w, torch.bfloat16).double().cpu()
    wrong[:, [7, 7 + pair]] = wrong[:, [7 + pair, 7]]  # column 7: a massive channel
    lim = bound(x.cpu(), wrong.abs(), ref, BF16_ULP)
    assert not (((x.double().cpu() @ wrong.t()) - ref).abs() <= lim).all()


def test_picked_config_bias_and_rows_alone():
    """The picked config (64 x 64 tiles) with a bias, and each row's result independent of the
    other rows (a 17-row x gives the first 17 rows of a 40-row one)."""
    n, k = 96, 256
    w = random_qweight("Q8_0", n, k, seed=3, device=DEV)
    x = _x(40, k, 2)
    b = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEV)
    assert qgemm.pick_config(40, n, 132) == qgemm.GemmConfig(block_m=64, block_n=64, num_warps=4)
    full = qgemm.gemm(x, w, b)
    _check(x, w, full, b)
    assert torch.equal(qgemm.gemm(x[:17], w, b), full[:17])


def test_stack_parts_land_in_their_columns():
    k = 256
    q, v = random_qweight("Q4_K", 48, k, seed=19, device=DEV), random_qweight("Q6_K", 16, k, seed=20, device=DEV)
    w = stack_rows([q, v])
    assert isinstance(w, QuantStack)
    x = _x(20, k, 8)
    b = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
    got = qgemm.gemm(x, w, b, config=SMALL)
    _check(x, w, got, b)
    assert torch.equal(got[:, 48:], qgemm.gemm(x, v, b[48:], config=SMALL))


def test_linear_routes_rows_by_count(monkeypatch):
    """qgemv.linear: up to MAX_TILED_ROWS contiguous rows on the skinny kernel (a row's bits as a
    decode step's); more rows, leading dimensions and a strided x on qgemm.gemm (the picked config)
    up to GEMM_MAX_ROWS; past it a dequantized copy and F.linear."""
    k = 128
    w = random_qweight("Q4_0", 24, k, seed=31, device=DEV)
    x = _x(90, k, 9)
    b = torch.randn(24, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEV)
    got = qgemv.linear(x, w, b)
    assert torch.equal(got, qgemm.gemm(x, w, b))
    _check(x, w, got, b)
    assert torch.equal(qgemv.linear(x[:20].reshape(4, 5, k), w), qgemm.gemm(x[:20], w).reshape(4, 5, 24))
    xt = torch.cat([x[:20], x[:20]], dim=1)[:, :k]
    assert torch.equal(qgemv.linear(xt, w), qgemm.gemm(x[:20], w))
    assert torch.equal(qgemv.linear(x[:20].contiguous(), w), qgemv.project(x[:20].contiguous(), w))
    monkeypatch.setattr(qgemv, "GEMM_MAX_ROWS", 64)
    dense = torch.nn.functional.linear(x, qtiles.dequantize(w, x.dtype), b)
    assert torch.equal(qgemv.linear(x, w, b), dense)
