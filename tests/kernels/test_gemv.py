"""The skinny projection kernel (Triton; its interpreter on CPU) against torch.

GPU runs of the same kernel in bf16 at the real model shapes are in tests/gpu/test_gpu_fused.py.
"""

from __future__ import annotations

import os

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

from fgchat.engine.kernels.gemv import (  # noqa: E402
    ONE_WAVE_GLU_TILE,
    WIDE_K_TILE,
    ProjConfig,
    pick_config,
    pick_split,
    project,
    project_glu,
    project_partials,
    wide_k_split,
    wins_over_cublas,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# what FusedStages reads of a Llama config (its stand-in decoders below)
LLAMA_CFG = SimpleNamespace(qk_norm=False, gemma_norms=False, activation="silu", layer_windows=())


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(DEV), w.to(DEV)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [(1, 48, 96, ProjConfig(16, 64)), (5, 40, 100, ProjConfig(16, 64)), (8, 64, 256, None),
     (16, 17, 33, ProjConfig(16, 64)), (2, 32, 1024, None), (3, 72, 384, ProjConfig(32, 128, 4, 6))],
)
def test_projection_matches_torch(m, n, k, cfg):
    x, w = _inputs(m, n, k, m * n + k)
    torch.testing.assert_close(project(x, w, cfg), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,i,k,cfg", [(1, 40, 96, ProjConfig(16, 64)), (6, 64, 256, None),
                                       (3, 32, 128, ProjConfig(32, 64, swap=True)),
                                       (2, 256, 256, ONE_WAVE_GLU_TILE)])
def test_glu_projection_is_linear_then_silu_mul(m, i, k, cfg):
    from fgchat.engine.kernels.fused import silu_mul

    x, w = _inputs(m, 2 * i, k, m + i + k)
    x16, w16 = x.half(), w.half()
    cfg = cfg or pick_config(i, k, glu=True)  # the plain call below must tile K the same way
    got = project_glu(x16, w16, cfg)
    assert got.shape == (m, i) and got.dtype == torch.float16
    # the same products the plain kernel computes, then the same activation kernel
    assert torch.equal(got, silu_mul(project(x16, w16, cfg)))
    torch.testing.assert_close(got.float(), F.silu(F.linear(x, w[:i])) * F.linear(x, w[i:]),
                               rtol=2e-2, atol=2e-2)


def test_glu_rejects_an_odd_weight():
    x, w = _inputs(1, 33, 64, 0)
    with pytest.raises(ValueError, match="even"):
        project_glu(x, w)


@pytest.mark.parametrize("m", [1, 7])
def test_swapped_operands_give_the_plain_product(m):
    x, w = _inputs(m, 96, 256, 40 + m)
    got = project(x, w, ProjConfig(32, 64, swap=True))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    one = project(x[:1].contiguous(), w, ProjConfig(32, 64, swap=True))
    assert torch.equal(one[0], got[0])  # a row's result does not depend on the other rows


def test_config_text_parses_and_rejects():
    assert ProjConfig.parse("64,128,4,3,1") == ProjConfig(64, 128, 4, 3, True)
    assert ProjConfig.parse("16,512,4,4") == ProjConfig(16, 512, 4, 4, False)
    with pytest.raises(ValueError, match="bn,bk"):
        ProjConfig.parse("16,512")
    assert ProjConfig.parse("32,256,4,3,1,4") == ProjConfig(32, 256, 4, 3, True, split=4)
    assert ProjConfig.parse("32,256,4,3,0,0") == ProjConfig(32, 256, 4, 3)
    for bad in ("16,512,4,4,1,2,1", "16,512,4,x", "16,512,4,4,0,-2", "16,512,4,4,0,1"):
        with pytest.raises(ValueError, match="bn,bk"):
            ProjConfig.parse(bad)


def test_rows_do_not_depend_on_batch_size():
    x, w = _inputs(8, 64, 256, 11)
    y8 = project(x, w)
    for r in (0, 5):
        assert torch.equal(project(x[r : r + 1].contiguous(), w)[0], y8[r])


def test_rejects_more_rows_than_its_tiles():
    from fgchat.engine.kernels.gemv import MAX_TILED_ROWS
    from fgchat.engine.step import MAX_ROWS as STEP_ROWS

    assert STEP_ROWS <= MAX_TILED_ROWS  # a verification step's rows all run here
    x, w = _inputs(MAX_TILED_ROWS + 1, 16, 32, 0)
    with pytest.raises(ValueError, match=f"at most {MAX_TILED_ROWS} rows"):
        project(x, w)


def test_rows_past_one_tile_are_their_one_row_results():
    """40 rows (a verification step at batch 8, block 5: three 16-row tiles): every row's
    projection, split-K partial sums, GLU output and LM head logits / pick are bit for bit those
    of that row alone, whichever tile and tile position it lands in. A cuBLAS-like reduction of
    another order (a different K tile) fails the same comparison."""
    from fgchat.engine.kernels.gemv import project_argmax

    x, w = _inputs(40, 48, 256, 21)
    x_bf, w_bf = x.bfloat16(), w.bfloat16()
    cfg = ProjConfig(16, 64)
    y, parts = project(x_bf, w_bf, cfg), project_partials(x, w, 2, cfg)
    wg = torch.cat([w, w.flip(0)]).contiguous()
    glu = project_glu(x, wg, cfg)
    logits, tokens = project_argmax(x, w, cfg)
    rows = (0, 15, 16, 17, 33, 39)
    for r in rows:
        one = x[r : r + 1].contiguous()
        assert torch.equal(project(x_bf[r : r + 1].contiguous(), w_bf, cfg)[0], y[r]), r
        assert torch.equal(project_partials(one, w, 2, cfg)[:, 0], parts[:, r]), r
        assert torch.equal(project_glu(one, wg, cfg)[0], glu[r]), r
        l1, t1 = project_argmax(one, w, cfg)
        assert torch.equal(l1[0], logits[r]) and int(t1[0]) == int(tokens[r]), r
    assert [int(t) for t in tokens] == [int(t) for t in logits.argmax(1)]
    other = ProjConfig(16, 32)  # another reduction order over K
    assert any(not torch.equal(project_logits_of(x[r : r + 1], w, other)[0], logits[r]) for r in rows)


def project_logits_of(x: torch.Tensor, w: torch.Tensor, cfg: ProjConfig) -> torch.Tensor:
    from fgchat.engine.kernels.gemv import project_logits

    return project_logits(x.contiguous(), w, cfg)


def test_config_and_routing_depend_on_shape_only():
    assert pick_config(2048, 2048).block_k == 512
    assert pick_config(576, 576).block_k == 128  # K not a multiple of 512: masked 128-wide tiles
    assert wins_over_cublas(torch.empty(2048, 2048)) and not wins_over_cublas(torch.empty(2048, 8192))
    assert pick_config(8192, 2048, glu=True) == ProjConfig(64, 256, 4, 3, swap=True)  # 1B gate/up
    assert pick_config(14336, 4096, glu=True) == ProjConfig(64, 256, 4, 3, swap=True)
    assert not pick_config(1536, 576, glu=True).swap  # SmolLM2's: the small-matrix rule


def _stages(tuning, hidden=2048, inter=8192, q=3072, pdl=True, sms=132, smem=None):
    from fgchat.engine.model.fused_step import FusedStages

    meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    layer = SimpleNamespace(wqkv=meta(q, hidden), bqkv=None, wo=meta(hidden, hidden), attn_norm=meta(hidden),
                            mlp_norm=meta(hidden), w_gate_up=meta(2 * inter, hidden), w_down=meta(hidden, inter))
    weights = SimpleNamespace(layers=[layer], lm_head=meta(32000, hidden),  # float32: no int8 pick copy
                              final_norm=meta(hidden), family=None)
    dec = SimpleNamespace(w=weights, cfg=LLAMA_CFG)
    return (FusedStages(dec, tuning, sms, pdl=pdl) if smem is None
            else FusedStages(dec, tuning, sms, pdl=pdl, smem_per_block=smem))


def test_routes_of_llama_1b_projections():
    from fgchat.engine.model.fused_step import Route
    from fgchat.protocol.tuning import Tuning

    st = _stages(Tuning())
    assert st.gate_up == Route(True, glu=True) and st.o == Route(True, split=4, config=WIDE_K_TILE)
    assert st.qkv == Route(True)  # ours at every size
    assert st.down == Route(True, split=4, config=WIDE_K_TILE)  # 32 column tiles x 4 slices: 128 programs
    assert pick_config(3072, 2048) == ProjConfig(32, 128, 4, 6)  # 1B qkv: the mid-size tile
    # above the size rule: cuBLAS without PDL (nothing launches early)
    assert _stages(Tuning(), pdl=False).qkv == Route(False)
    st = _stages(Tuning(proj_configs="qkv=32,256,4,4;down=32,256,4,4;gate_up=64,128,4,4"))
    tile = ProjConfig(32, 256, 4, 4)
    assert st.gate_up == Route(True, glu=True, config=ProjConfig(64, 128, 4, 4))
    assert st.qkv == Route(True, config=tile) and st.down == Route(True, split=2, config=tile)
    # a split given with the tile replaces pick_split's
    st = _stages(Tuning(proj_configs="down=32,256,4,3,1,4"))
    assert st.down == Route(True, split=4, config=ProjConfig(32, 256, 4, 3, True, split=4))


def test_a_split_that_cannot_be_added_is_one_user_error():
    from fgchat.protocol.errors import FgchatError
    from fgchat.protocol.tuning import Tuning

    for bad, match in (("gate_up=64,256,4,3,1,2", "gate_up cannot be split"),
                       ("down=32,256,4,3,1,3", "split 3 does not cut K=8192"),
                       ("o=32,512,4,3,0,8", "split 8 does not cut K=2048")):
        with pytest.raises(FgchatError, match=match):
            _stages(Tuning(proj_configs=bad))
    with pytest.raises(FgchatError, match="too wide"):  # a 5000-wide o feeds the norm, but unsplit
        _stages(Tuning(proj_configs="o=32,256,4,3,0,2"), hidden=5120)


def test_wide_k_split_fills_the_sms_once():
    from fgchat.engine.model.fused_step import Route
    from fgchat.protocol.tuning import Tuning

    assert wide_k_split(2048, 8192, 132) == 4  # 1B down: 32 column tiles x 4
    assert wide_k_split(1536, 8960, 132) == 5  # Qwen2.5-1.5B down: 24 x 5, slices of 7 tiles
    assert wide_k_split(2048, 8192, 114) == 0  # 3 slices do not cut 32 tiles; 2 x 32 fills 56%
    assert wide_k_split(2048, 8192, 40) == 0  # no split fits one wave: cuBLAS keeps it
    assert wide_k_split(3072, 8192, 132) == 0  # Llama-3.2-3B: 48 x 2 fills 73%, unmeasured: cuBLAS
    st = _stages(Tuning(), hidden=3072, inter=8192, q=5120)
    assert st.down == Route(False) and st.o == Route(False)
    assert wide_k_split(2048, 8000, 132) == 0  # K not whole 256-wide tiles
    st = _stages(Tuning(), hidden=1536, inter=8960, q=2048)
    assert st.down == Route(True, split=5, config=WIDE_K_TILE)
    assert st.o == Route(True, split=pick_split(1536, 1536, 132))  # small: pick_split's 16-row tile


def test_one_wave_glu_only_where_the_64_row_tile_takes_two_waves():
    from fgchat.engine.kernels.gemv import ONE_WAVE_GLU_SMEM, one_wave_glu
    from fgchat.protocol.tuning import Tuning

    h200 = 227 * 1024
    assert one_wave_glu(14336, 4096, 132, h200)  # 8B: 224 -> 112 programs
    assert not one_wave_glu(8192, 2048, 132, h200)  # 1B: 128 programs, one wave already
    assert not one_wave_glu(8960, 1536, 132, h200)  # Qwen2.5-1.5B: 70 programs would fill 53%
    assert not one_wave_glu(18944, 3584, 132, h200)  # 148 programs: two waves either way
    assert not one_wave_glu(1536, 576, 132, h200)  # SmolLM2: the small tile
    assert not one_wave_glu(14336, 4096, 132, ONE_WAVE_GLU_SMEM - 1)
    assert _stages(Tuning()).gate_up.config is None  # 1B keeps pick_config's tile


def test_routes_of_smollm2_projections():
    from fgchat.engine.model.fused_step import Route
    from fgchat.protocol.tuning import Tuning

    st = _stages(Tuning(), hidden=576, inter=1536, q=960)
    assert st.o == Route(True, split=pick_split(576, 576, 132)) and st.o.config is None
    assert st.down == Route(True, split=pick_split(576, 1536, 132)) and st.down.config is None


def test_wide_k_tile_partials_sum_to_the_projection():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1024, generator=g)
    w = torch.randn(80, 1024, generator=g) * 0.05  # 80 rows: the second column tile is masked
    parts = project_partials(x, w, 4, WIDE_K_TILE)
    assert parts.shape == (4, 3, 80)
    ref = x.double() @ w.double().T
    assert torch.allclose(parts.sum(0).double(), ref, rtol=1e-4, atol=1e-4)
    for s in range(4):  # slab s is K slice s's sum
        sl = slice(256 * s, 256 * (s + 1))
        assert torch.allclose(parts[s].double(), x[:, sl].double() @ w[:, sl].double().T, rtol=1e-4, atol=1e-4)


def test_routes_of_llama_8b_projections():
    from fgchat.engine.model.fused_step import Route
    from fgchat.protocol.tuning import Tuning

    st = _stages(Tuning(), hidden=4096, inter=14336, q=6144)
    assert st.qkv == Route(True) and st.gate_up == Route(True, glu=True, config=ONE_WAVE_GLU_TILE)
    # o and down: 64 column tiles x 2 slices, one wave on 132 SMs
    assert st.o == st.down == Route(True, split=2, config=WIDE_K_TILE)
    assert pick_config(6144, 4096) == ProjConfig(64, 256, 4, 3, swap=True) == WIDE_K_TILE
    # 114 SMs (H100 PCIe): 128 programs take two waves, so o keeps pick_split's slices; 112
    # gate/up tiles still fit one wave; a block of 100 KB shared memory keeps the 64-row GLU tile
    st = _stages(Tuning(), hidden=4096, inter=14336, q=6144, sms=114, smem=100 * 1024)
    assert st.o == Route(True, split=pick_split(4096, 4096, 114)) and st.gate_up == Route(True, glu=True)
    assert _stages(Tuning(), hidden=4096, inter=14336, q=6144, sms=114).gate_up.config == ONE_WAVE_GLU_TILE
    # a tile given for a role wins over the shape rules
    st = _stages(Tuning(proj_configs="gate_up=64,256,4,3,1;o=64,256,4,3,1,8"), hidden=4096, inter=14336, q=6144)
    assert st.gate_up.config == ProjConfig(64, 256, 4, 3, swap=True) and st.o.split == 8


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_decoder_step_matches_unfused(tiny_model_dirs, family):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram, Variant

    eng = Engine(EngineConfig(model=str(tiny_model_dirs[family]), device="cpu", max_context=64,
                              dtype="float32"))
    fused = StepProgram(Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True),
                        eng.cache, eng.bufs, eng.attention)
    for t in eng.cache.k + eng.cache.v:
        t.normal_()
    for b in (1, 3):
        eng.bufs.stage(list(range(5, 5 + b)), [9, 20, 30][:b], [4, 0, 7][:b], [0.0] * b, [1.0] * b,
                       [0] * b, [0] * b)
        eng.program.max_len_hint = fused.max_len_hint = 31
        picked = eng.program.run_eager(b, variant=Variant.GREEDY).tokens.clone()  # the head pick's
        with eng.decoder.exact_head():
            ref = eng.program.run_eager(b, variant=Variant.GREEDY)
        ref_logits, ref_k = ref.logits.clone(), [k.clone() for k in eng.cache.k]
        assert torch.equal(picked, ref.tokens)
        out = fused.run_eager(b, variant=Variant.GREEDY)
        torch.testing.assert_close(out.logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(out.tokens, ref.tokens)  # the LM head kernel's own greedy pick
        for k, rk in zip(eng.cache.k, ref_k):
            torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)


def test_float32_output_holds_the_input_dtype_rounding():
    x, w = _inputs(3, 48, 96, 5)
    x16, w16 = x.half(), w.half()
    y = project(x16, w16, ProjConfig(16, 64), out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, project(x16, w16, ProjConfig(16, 64)).float())


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_slabs_are_the_products_of_their_k_slices(split):
    x, w = _inputs(3, 48, 256, split)
    parts = project_partials(x, w, split, ProjConfig(16, 64))
    assert parts.shape == (split, 3, 48) and parts.dtype == torch.float32
    cut = 256 // split
    for s in range(split):
        sl = slice(s * cut, (s + 1) * cut)
        torch.testing.assert_close(parts[s], F.linear(x[:, sl], w[:, sl]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split,cfg", [(4, WIDE_K_TILE), (2, WIDE_K_TILE), (1, ProjConfig(16, 64)),
                                       (2, ProjConfig(32, 64, swap=True))])
def test_two_tiles_before_the_wait_give_the_same_sums(split, cfg):
    """preload=2 loads the second weight tile early; the sum runs tile 0, tile 1, ... as before."""
    from fgchat.engine.kernels.gemv import _plan

    g = torch.Generator().manual_seed(split)
    k = 2 * split * cfg.block_k  # two tiles a slice (o's wide-K slices), then more below
    for kk in (k, 2 * k):
        x = torch.randn(5, kk, generator=g)
        w = torch.randn(128, kk, generator=g) * 0.05  # whole column tiles: the early load applies
        plan = _plan(5, 128, kk, x.dtype, w.dtype, torch.float32, split, False, False, cfg, preload=2)
        assert plan.kw["PRE_TILES"] == 2
        if split > 1:
            one, two = (project_partials(x, w, split, cfg, preload=p) for p in (1, 2))
        else:
            one, two = (project(x, w, cfg, preload=p) for p in (1, 2))
        assert torch.equal(one, two)
        ref = (x.double() @ w.double().T).float()
        assert torch.allclose(two.sum(0) if split > 1 else two, ref, rtol=1e-4, atol=1e-4)


def test_preload_falls_back_to_one_tile_where_two_do_not_apply():
    from fgchat.engine.kernels.gemv import _plan

    def pre(n, k, split, cfg, glu=False):
        return _plan(1, n, k, torch.float32, torch.float32, torch.float32, split, False, True, cfg, glu,
                     preload=2).kw["PRE_TILES"]

    assert pre(2048, 2048, 4, WIDE_K_TILE) == 2  # 1B's o: two 256-wide tiles a slice
    assert pre(2048, 1024, 4, WIDE_K_TILE) == 1  # one tile a slice
    assert pre(2048, 2048, 1, ProjConfig(16, 64), glu=True) == 1  # gate/up: four tiles would be live
    assert pre(100, 2048, 1, ProjConfig(16, 64)) == 1  # masked column tiles
    with pytest.raises(ValueError, match="preload"):
        project(torch.zeros(1, 128), torch.zeros(16, 128), ProjConfig(16, 64), preload=3)


def test_split_k_rejects_slices_of_partial_tiles():
    x, w = _inputs(2, 32, 192, 0)
    with pytest.raises(ValueError, match="whole"):
        project_partials(x, w, 2, ProjConfig(16, 64))  # 96-wide slices of 64-wide tiles


def test_norm_adds_partial_sums_in_slab_order():
    from fgchat.engine.kernels.fused import add_rms_norm

    g = torch.Generator().manual_seed(8)
    h = torch.randn(3, 64, generator=g).half()
    parts = torch.randn(3, 3, 64, generator=g)
    w = torch.rand(64, generator=g).half() + 0.5
    got_h, got_y = add_rms_norm(h, parts, w, 1e-5)
    delta = ((parts[0] + parts[1]) + parts[2]).half()  # the projection's own rounding
    want_h, want_y = add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(got_h, want_h) and torch.equal(got_y, want_y)


def test_split_depends_on_shape_and_sm_count_only():
    assert pick_split(2048, 2048, 132) == 4  # Llama-3.2-1B o: 128 column tiles -> 512 programs
    assert pick_split(2048, 8192, 132) == 2  # its down projection: two 4096-wide slices
    assert pick_split(4096, 14336, 132) == 2  # Llama-3.1-8B down
    assert pick_split(576, 1536, 132) == 3  # SmolLM2 down: three 512-wide slices
    assert pick_split(576, 576, 132) == 1  # too short to cut
    assert pick_split(16384, 2048, 132) == 1  # enough column tiles already


def test_lm_head_argmax_is_torch_argmax_with_ties():
    from fgchat.engine.kernels.gemv import project_argmax, project_logits

    x, w = _inputs(4, 200, 64, 3)
    w[150] = w[37]  # column 150 duplicates 37: equal logits, the first must win
    w[199] = w[37]
    x[2] = 0.0  # an all-zero row: every logit ties at 0, index 0 wins
    logits, tokens = project_argmax(x, w, ProjConfig(16, 64))
    assert torch.equal(logits, project_logits(x, w, ProjConfig(16, 64)))
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    assert tokens[2].item() == 0


@pytest.mark.parametrize("m,n,cfg", [(1, 200, ProjConfig(16, 64)), (5, 200, ProjConfig(32, 64)), (8, 256, None)])
def test_lm_head_sampled_pick_is_the_unfiltered_sample(m, n, cfg):
    """The sampled pick in the LM head's epilogue: per row sampling.sample(filtered=False)'s token
    on the same logits (torch ops, the reference), T 0 rows the argmax; ragged N included."""
    from fgchat.engine.kernels import sampling
    from fgchat.engine.kernels.gemv import project_argmax, project_logits

    x, w = _inputs(m, n, 64, 11 + m)
    x = x * 8  # logits of a few units, so that the noise and the logits both decide
    temps = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.05, 0.7, 1.0, 2.0][:m], device=DEV)
    seeds = torch.tensor([3, 2**40 + 1, 7, 9, 11, 13, 15, 17][:m], device=DEV)
    for step in range(6):
        positions = torch.arange(m, device=DEV) * 5 + step
        logits, tokens = project_argmax(x, w, cfg, sample=(temps, seeds, positions))
        assert torch.equal(logits, project_logits(x, w, cfg))
        ones, zeros = torch.ones(m, device=DEV), torch.zeros(m, dtype=torch.int64, device=DEV)
        ref = sampling.sample(logits, temps, ones, zeros, seeds, positions, filtered=False, use_triton=False)
        assert torch.equal(tokens, ref), (step, tokens, ref)
        assert tokens[0] == torch.argmax(logits[0])
    others = set()  # the pick moves with the position for a T > 0 row, not for the T 0 row
    for step in range(12):
        positions = torch.full((m,), step, device=DEV)
        others.add(int(project_argmax(x, w, cfg, sample=(temps, seeds, positions))[1][min(2, m - 1)]))  # T 1
    assert len(others) > 1 or m == 1


def test_step_inputs_kernel():
    from fgchat.engine.kernels.fused import step_inputs

    g = torch.Generator().manual_seed(2)
    embed = torch.randn(50, 40, generator=g)
    ids, pos, slots = torch.tensor([3, 49, 0]), torch.tensor([0, 7, 100]), torch.tensor([2, 0, 5])
    lens, slots32 = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    h = step_inputs(ids, pos, slots, embed, lens, slots32)
    assert torch.equal(h, embed[ids]) and lens.tolist() == [1, 8, 101] and slots32.tolist() == [2, 0, 5]


def test_lm_head_logits_are_float32_sums_not_rounded():
    """Half-precision inputs (fp16: the interpreter's dot does not take bf16): the logits keep the
    float32 sums, within float32 rounding of the exact products, not half-precision values."""
    from fgchat.engine.kernels.gemv import project_logits

    x, w = _inputs(3, 300, 128, 11)
    x, w = x.half(), w.half()
    got = project_logits(x, w, ProjConfig(16, 64))
    exact = x.double() @ w.double().T
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= 1e-5 * exact.abs().max()).all()
    assert not torch.equal(got, got.half().float())  # not fp16 values
