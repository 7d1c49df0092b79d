"""The quantized skinny projection (kernels.qgemv), Triton's interpreter on CPU, against the
float64 composition of the same planes (tests/kernels/qweights.py), on rows with massive-activation
channels (qgemv.linear's prefill rows: tests/kernels/test_qgemm.py). GPU runs at the real model
shapes, with timings: tests/gpu/test_gpu_qgemv.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

import interpreter_rounding  # noqa: E402
from qweights import FORMATS, bound, compose, outlier_rows, random_qweight, terms  # noqa: E402

from fgchat.engine.kernels import qgemv, qtiles  # noqa: E402
from fgchat.engine.quant.qweight import QuantStack, stack_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RNE = interpreter_rounding.install()
pytestmark = pytest.mark.skipif(not RNE and DEV == "cpu", reason="bf16 needs the interpreter's RNE patch")
BF16_ULP = 2.0**-7  # one ulp of bf16 relative to the value (8 significant bits)


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return outlier_rows(m, k, seed).to(dtype).to(DEV)


@pytest.mark.parametrize("fmt", FORMATS)
def test_project_matches_float64_composition(fmt):
    n, k = 40, 512  # N not a multiple of the tile; two K-quant blocks
    w = random_qweight(fmt, n, k, seed=len(fmt) * 7, device=DEV)
    w64, mag = compose(w), terms(w)
    plain = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    for x in (_x(3, k, 1), plain):
        ref = x.double().cpu() @ w64.t()
        err = (qgemv.project(x, w).double().cpu() - ref).abs()
        assert (err <= bound(x.cpu(), mag, ref, BF16_ULP)).all(), f"{fmt}: worst {err.max().item():.3g}"
        # the float32 sums alone: the unrounded logits within K 2^-24 of the terms
        err32 = (qgemv.project_logits(x, w).double().cpu() - ref).abs()
        assert (err32 <= bound(x.cpu(), mag, ref, 0.0)).all(), f"{fmt}: worst {err32.max().item():.3g}"
    # the bound sees a weight in the wrong place: two columns' fields swapped
    for x, cols in ((_x(3, k, 1), [7, 8]), (plain, [8, 9])):  # column 7: a massive channel
        wrong = w64.clone()
        wrong[:, cols] = wrong[:, cols[::-1]]
        ref = x.double().cpu() @ w64.t()
        assert not (((x.double().cpu() @ wrong.t()) - ref).abs() <= bound(x.cpu(), mag, ref, BF16_ULP)).all()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
def test_project_fp16_activations(fmt):
    k = 256
    w = random_qweight(fmt, 32, k, seed=3, device=DEV, dtype=torch.float16)
    x = _x(2, k, 2, torch.float16)
    w64 = compose(w)
    ref = x.double().cpu() @ w64.t()
    got = qgemv.project(x, w).double().cpu()
    assert ((got - ref).abs() <= bound(x.cpu(), terms(w), ref, 2.0**-10)).all()


@pytest.mark.parametrize("fmt,tiles", [("Q4_1", (64, 512)), ("Q5_K", (64, 256, 512)), ("int4", (128, 512))])
def test_every_tile_width_gives_the_product(fmt, tiles):
    """Tiles of one unit up to the widest (Q5_K: its high bits reloaded per block inside a tile)."""
    k = 512
    w = random_qweight(fmt, 24, k, seed=5, device=DEV)
    x = _x(2, k, 3)
    w64 = compose(w)
    ref = x.double().cpu() @ w64.t()
    for bk in tiles:
        got = qgemv.project_logits(x, w, config=qgemv.QConfig(block_n=16, block_k=bk)).double().cpu()
        assert ((got - ref).abs() <= bound(x.cpu(), terms(w), ref, 0.0)).all(), f"{fmt} tile {bk}"


# (K, its tile, a split) per format: K's widest tile is no power of two where the format allows
# one (not fp8 nor Q6_K), the tile the widest multiple of qdot.UNIT up to WIDEST dividing K
ODD_K = {"Q8_0": (576, 192, 3), "Q4_0": (576, 288, 3), "Q4_1": (576, 288, 2), "Q4_K": (768, 384, 2),
         "Q5_K": (768, 384, 2), "Q6_K": (768, 256, 3), "fp8": (576, 64, 3), "int4": (384, 384, 3)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_of_any_whole_units_give_the_product(fmt):
    """The picked tile at a K that is no power of two (SmolLM2's 576), whole and split as a
    norm-fed launch splits it (Q5_K's 384: its high bits reloaded per unit)."""
    k, tile, split = ODD_K[fmt]
    assert qgemv.tile_k(fmt, k) == tile
    w = random_qweight(fmt, 24, k, seed=37, device=DEV)
    x = _x(2, k, 14)
    ref = x.double().cpu() @ compose(w).t()
    lim = bound(x.cpu(), terms(w), ref, 0.0)
    assert ((qgemv.project_logits(x, w).double().cpu() - ref).abs() <= lim).all()
    cfg = qgemv.pick_config(fmt, 24, k, split)
    parts = qgemv.project_partials(x, w, split, config=cfg).double().cpu()
    assert ((parts.sum(0) - ref).abs() <= lim).all(), f"{fmt} split {split} tile {cfg.block_k}"


# (role, N, K, format, norm-fed) of SmolLM2-135M's Q4_1 file (its head Q8_0) and the 1B preset
MODEL_SHAPES = [("qkv", 960, 576, "Q4_1", False), ("o", 576, 576, "Q4_1", True), ("gate", 1536, 576, "Q4_1", False),
                ("down", 576, 1536, "Q4_1", True), ("head", 49152, 576, "Q8_0", False)] + [
    (role, n, k, fmt, fed) for fmt in ("int4", "fp8", "Q4_K") for role, n, k, fed in
    (("qkv", 3072, 2048, False), ("o", 2048, 2048, True), ("gate", 8192, 2048, False), ("down", 2048, 8192, True))]


@pytest.mark.parametrize("sms", [132, 114])
def test_pick_gives_at_least_the_bf16_kernels_programs(sms):
    """Each model shape's launch: at least as many programs as the bf16 kernel's picker gives the
    shape (gemv.pick_config / pick_split, the reference), at least two per SM unless the rows are
    at the narrowest tile and K at its most slices, and a tile and split the kernel takes."""
    from fgchat.engine.kernels import gemv
    from fgchat.engine.quant.qweight import QuantWeight

    for role, n, k, fmt, fed in MODEL_SHAPES:
        w = QuantWeight(fmt, (n, k), {}, torch.bfloat16)
        split = qgemv.pick_split(w, sms) if fed else 1
        cfg = qgemv.pick_config(fmt, n, k, split, sms)
        programs = -(-n // cfg.block_n) * split
        dense = gemv.pick_config(n, k, glu=role == "gate")
        dense_split = gemv.pick_split(n, k, sms, dense) if fed else 1
        assert programs >= -(-n // dense.block_n) * dense_split, (role, n, k, fmt)
        most = max(s for s in qgemv.SPLITS if k % s == 0 and (k // s) % qgemv.UNIT[fmt] == 0
                   and k // s >= qgemv.MIN_SLICE) if fed else 1
        assert programs >= 2 * sms or (cfg.block_n == qgemv.NARROWEST and split >= min(most, 2)), (role, fmt)
        assert (k // split) % cfg.block_k == 0 and cfg.block_k % qgemv.UNIT[fmt] == 0


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "fp8"])
def test_rows_do_not_depend_on_the_batch_size(fmt):
    """A row's bits are the same alone, among a decode step's rows and among a verification
    step's (three 16-row tiles, the last one partial)."""
    k = 512
    w = random_qweight(fmt, 48, k, seed=11, device=DEV)
    x = _x(40, k, 4)
    full, parts = qgemv.project(x, w), qgemv.project_partials(x[:20].contiguous(), w, 2)
    for rows in (slice(0, 1), slice(0, 7), slice(33, 40)):
        assert torch.equal(qgemv.project(x[rows].contiguous(), w), full[rows]), rows
    for rows in (slice(0, 3), slice(17, 20)):
        assert torch.equal(qgemv.project_partials(x[rows].contiguous(), w, 2), parts[:, rows]), rows
    if fmt == "fp8":  # the head's pick over row tiles: each row's first maximum of its own logits
        logits, tokens = qgemv.project_argmax(x, w)
        assert torch.equal(logits, qgemv.project_logits(x, w))
        assert torch.equal(tokens, logits.argmax(dim=1))


def test_partials_sum_to_the_projection():
    k = 512
    w = random_qweight("Q6_K", 32, k, seed=12, device=DEV)
    x = _x(3, k, 5)
    parts = qgemv.project_partials(x, w, 2).double().cpu()
    w64 = compose(w)
    ref = x.double().cpu() @ w64.t()
    assert ((parts.sum(0) - ref).abs() <= bound(x.cpu(), terms(w), ref, 0.0)).all()


@pytest.mark.parametrize("fmt", ["Q4_0", "int4", "Q5_K", "Q6_K", "fp8"])
def test_glu_is_silu_of_gate_times_up_with_gemv_roundings(fmt):
    i, k = 32, 256
    w = random_qweight(fmt, 2 * i, k, seed=13, device=DEV)
    x = _x(3, k, 6)
    got = qgemv.project_glu(x, w)
    gu = qgemv.project(x, w).float()  # the same sums, rounded to bf16
    g, u = gu[:, :i], gu[:, i:]
    s = (g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float()
    ref = (s * u).to(torch.bfloat16)
    torch.testing.assert_close(got, ref, rtol=2 * BF16_ULP, atol=1e-6)
    # and against float64: silu(gate) * up within the roundings of g, u, s and the product
    w64 = compose(w)
    gd, ud = (x.double().cpu() @ w64.t()).split(i, dim=1)
    r64 = gd / (1 + torch.exp(-gd)) * ud
    assert ((got.double().cpu() - r64).abs() <= 4 * BF16_ULP * r64.abs() + 1e-3 * ud.abs() + 1e-6).all()


def test_logits_and_argmax():
    n, k = 300, 256  # several programs, a last one partly masked
    w = random_qweight("Q8_0", n, k, seed=17, device=DEV)
    x = _x(3, k, 7)
    logits, tokens = qgemv.project_argmax(x, w)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, qgemv.project_logits(x, w))
    assert torch.equal(tokens.cpu(), logits.cpu().argmax(dim=1))
    w64 = compose(w)
    ref = x.double().cpu() @ w64.t()
    assert ((logits.double().cpu() - ref).abs() <= bound(x.cpu(), terms(w), ref, 0.0)).all()
    for m in (1, 2):
        sub_logits, sub_tokens = qgemv.project_argmax(x[:m].contiguous(), w)
        assert torch.equal(sub_logits, logits[:m]) and torch.equal(sub_tokens, tokens[:m])


def test_stack_of_formats_fills_each_parts_columns():
    k = 256
    q, v = random_qweight("Q4_K", 32, k, seed=19, device=DEV), random_qweight("Q6_K", 16, k, seed=20, device=DEV)
    w = stack_rows([q, v])
    assert isinstance(w, QuantStack) and w.shape == (48, k)
    x = _x(2, k, 8)
    assert torch.equal(qgemv.project(x, w), torch.cat([qgemv.project(x, q), qgemv.project(x, v)], dim=1))
    parts = qgemv.project_partials(x, w, 2)
    assert torch.equal(parts[:, :, 32:], qgemv.project_partials(x, v, 2))
    merged = stack_rows([q, random_qweight("Q4_K", 8, k, seed=21, device=DEV)])
    assert merged.fmt == "Q4_K" and merged.shape == (40, k)
    assert torch.equal(qgemv.project(x, merged)[:, :32], qgemv.project(x, q))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_K", "Q6_K", "fp8"])
def test_dequantize_rows_and_whole(fmt):
    n, k = 20, 512
    w = random_qweight(fmt, n, k, seed=23, device=DEV)
    ids = torch.tensor([3, 0, 19, 3], device=DEV)
    w64 = compose(w)
    rows = qtiles.dequantize_rows(w, ids, torch.float32).double().cpu()
    ref = w64[ids.cpu()]
    assert ((rows - ref).abs() <= ref.abs() * 2.0**-24).all()
    assert torch.equal(qtiles.dequantize_rows(w, ids), qtiles.dequantize_rows(w, ids, torch.float32).to(torch.bfloat16))
    whole = qtiles.dequantize(w, torch.float32).double().cpu()
    assert ((whole - w64).abs() <= w64.abs() * 2.0**-24).all()


def test_step_inputs_writes_lengths_slots_and_rows():
    w = random_qweight("Q8_0", 10, 64, seed=29, device=DEV)
    ids, pos, slots = (torch.tensor(v, device=DEV) for v in ([4, 9, 4], [0, 7, 30], [2, 0, 1]))
    seq_lens = torch.zeros(3, dtype=torch.int32, device=DEV)
    slots32 = torch.zeros(3, dtype=torch.int32, device=DEV)
    h = qtiles.step_inputs(ids, pos, slots, w, seq_lens, slots32)
    assert torch.equal(h, qtiles.dequantize_rows(w, ids))
    assert seq_lens.tolist() == [1, 8, 31] and slots32.tolist() == [2, 0, 1]
