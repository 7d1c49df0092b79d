"""Fused Triton kernels vs the torch compositions they replace (GPU, bf16 and fp16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def close_to_torch(got: torch.Tensor, ref: torch.Tensor, frac: float = 0.02) -> None:
    """At most one ulp apart everywhere, and identical in all but a small fraction of elements."""
    assert torch.isfinite(got).all()
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs().clamp_min(1e-3)
    assert ((got.float() - ref.float()).abs() <= ulp * 1.01 + 1e-6).all()
    assert (got != ref).float().mean().item() <= frac


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 576), (8, 2048), (5, 4096)])
def test_add_rms_norm(dtype, rows, n):
    from fgchat.engine.kernels.fused import add_rms_norm
    from fgchat.engine.model.ops import rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows * n)
    h = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
    d = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
    w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)
    h2, y = add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(h2, h + d)
    close_to_torch(y, rms_norm(h + d, w, 1e-5))
    h3, y3 = add_rms_norm(h, None, w, 1e-5)
    assert h3 is h
    close_to_torch(y3, rms_norm(h, w, 1e-5))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (8, 8192), (3, 8960)])
def test_silu_mul(rows, inter):
    from fgchat.engine.kernels.fused import silu_mul

    gu = torch.randn(rows, 2 * inter, device="cuda").to(torch.bfloat16)
    g, u = gu.chunk(2, dim=-1)
    close_to_torch(silu_mul(gu), F.silu(g) * u)


@pytest.mark.parametrize("b", [1, 5, 8])
def test_advance_feeds_next_step_and_pinned_host_buffer(b):
    """The next step's ids are the tokens, positions move by one, the host's pinned buffer holds
    the tokens once an event behind the launch completes; lanes past b are untouched."""
    from fgchat.engine.kernels.fused import advance

    tokens = torch.randint(0, 128_000, (b,), device="cuda")
    rows = torch.randint(0, 4096, (2, 16), device="cuda")
    before = rows.clone()
    host = torch.full((16,), -1, dtype=torch.int64, pin_memory=True)
    advance(tokens, rows[0, :b], rows[1, :b], host[:b])
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert torch.equal(host[:b], tokens.cpu()) and (host[b:] == -1).all()
    assert torch.equal(rows[0, :b], tokens) and torch.equal(rows[1, :b], before[1, :b] + 1)
    assert torch.equal(rows[:, b:], before[:, b:])


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (9, 3, 64), (12, 2, 128), (8, 8, 128)])
def test_rope_kv_write(hq, hkv, d):
    from fgchat.engine.kernels.fused import rope_kv_write
    from fgchat.engine.model.ops import apply_rope

    t, rows = 4096, 6
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    fr = torch.arange(t, device="cuda").float()[:, None] * inv[None]
    emb = torch.cat([fr, fr], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device="cuda").bfloat16()
    pos = torch.tensor([0, 1, 77, 3000, 4095, 5], device="cuda")
    slots = torch.tensor([7, 0, 3, 1, 2, 6], device="cuda")
    kc = torch.full((8, t, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc = kc.clone()
    q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d)

    def exact_and_bound(x):  # fp32 rotation of the bf16 inputs, and the rounding error bound
        c, s_ = cos[pos].float()[:, None, :], sin[pos].float()[:, None, :]
        a, b = x.float() * c, rotate(x.float()) * s_
        eps = torch.finfo(torch.bfloat16).eps
        return a + b, eps * (a.abs() + b.abs() + (a + b).abs()) * 1.01 + 1e-6

    from fgchat.engine.model.ops import rotate_half as rotate

    for got, x in ((q, qkv[:, : hq * d].view(rows, hq, d)),
                   (kc[slots, pos], qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d))):
        exact, bound = exact_and_bound(x)
        ref = apply_rope(x, cos[pos], sin[pos])
        assert torch.isfinite(got).all()
        assert ((got.float() - exact).abs() <= bound).all()  # as close as torch's own rounding
        assert ((ref.float() - exact).abs() <= bound).all()
        # bits may differ from torch's (the products round in another order), never the bound
    assert torch.equal(vc[slots, pos], qkv[:, (hq + hkv) * d :].view(rows, hkv, d))
    written = torch.zeros(8, t, dtype=torch.bool, device="cuda")
    written[slots, pos] = True
    assert torch.isnan(kc[~written]).all()  # nothing else touched


# (M rows, N, K): attention output / MLP down of Llama-3.2-1B, SmolLM2-135M, Qwen2.5-1.5B
PROJ_SHAPES = [(1, 2048, 2048), (8, 2048, 2048), (1, 576, 576), (3, 576, 1536), (8, 1536, 1536),
               (1, 6144, 4096), (8, 4096, 4096)]  # the last two: Llama-3.1-8B qkv / o (big() tile)


@pytest.mark.parametrize("m,n,k", PROJ_SHAPES)
def test_projection_bf16_close_to_cublas(m, n, k):
    from fgchat.engine.kernels.gemv import project

    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    y, ref = project(x, w).float(), F.linear(x, w).float()
    # float32 accumulation on both sides, different order: within one bf16 rounding
    assert ((y - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all()


def test_projection_rows_identical_at_every_batch_size():
    from fgchat.engine.kernels.gemv import project

    x = torch.randn(8, 2048, device="cuda").bfloat16()
    w = (torch.randn(2048, 2048, device="cuda") * 0.02).bfloat16()
    y8 = project(x, w)
    for r in range(8):
        assert torch.equal(project(x[r : r + 1].contiguous(), w)[0], y8[r])


# (M, I, K): gate/up of Llama-3.2-1B, SmolLM2-135M, Llama-3.1-8B; configs: the shape rule and the
# swapped-operand tiles
@pytest.mark.parametrize("m,i,k", [(1, 8192, 2048), (8, 8192, 2048), (1, 1536, 576), (2, 14336, 4096)])
@pytest.mark.parametrize("cfg", [None, "64,128,4,4,1"])
def test_glu_projection_bf16(m, i, k, cfg):
    from fgchat.engine.kernels.fused import silu_mul
    from fgchat.engine.kernels.gemv import ProjConfig, pick_config, project, project_glu

    cfg = ProjConfig.parse(cfg) if cfg else pick_config(i, k, glu=True)
    g = torch.Generator(device="cuda").manual_seed(i + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * i, k, device="cuda", generator=g) * 0.02).bfloat16()
    got = project_glu(x, w, cfg, pdl=True)
    # the plain kernel's products, then the activation kernel: the same bits
    assert torch.equal(got, silu_mul(project(x, w, cfg)))
    ref = silu_mul(F.linear(x, w)).float()
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-6 + 2e-3).all()
    one = project_glu(x[:1].contiguous(), w, cfg)
    assert torch.equal(one[0], got[0])


# (M, N, K, wide): Llama-3.1-8B's down and o on pick_split's split of the big() tile (GPUs whose one
# wave the wide-K rule cannot fill); Llama-3.2-1B's, Qwen2.5-1.5B's and 8B's down and o on the wide-K tile
@pytest.mark.parametrize("m,n,k,wide", [(1, 4096, 14336, False), (8, 4096, 4096, False), (1, 2048, 8192, True),
                                        (8, 2048, 8192, True), (3, 1536, 8960, True), (1, 4096, 14336, True),
                                        (8, 4096, 4096, True)])
def test_split_partials_sum_to_the_projection(m, n, k, wide):
    from fgchat.engine.kernels.gemv import WIDE_K_TILE, pick_split, project_partials, wide_k_split

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split, cfg = (wide_k_split(n, k, sms), WIDE_K_TILE) if wide else (pick_split(n, k, sms), None)
    assert split > 1
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    parts = project_partials(x, w, split, cfg, pdl=True)
    y, ref = parts.sum(0), F.linear(x.float(), w.float())
    assert ((y - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all()
    one = project_partials(x[:1].contiguous(), w, split, cfg)
    assert torch.equal(one[:, 0], parts[:, 0])  # a row's sums do not depend on the other rows
    # two weight tiles before the PDL wait (fused_step.PROJ_PRELOAD): the same tiles in the same order
    assert torch.equal(project_partials(x, w, split, cfg, pdl=True, preload=2), parts)


def test_engine_with_8b_one_wave_tiles_close_to_float32_reference(tmp_path):
    """A model with Llama-3.1-8B's layer shapes (two layers): o and down in two wide-K slices each,
    gate/up on the 128-row one-wave tile; in every graph mode each greedy step's logits against the
    float32 reference over the same tokens."""
    import tiny_models
    from reference_steps import greedy_steps_vs_reference

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.kernels.gemv import ONE_WAVE_GLU_TILE, WIDE_K_TILE, one_wave_glu, wide_k_split
    from fgchat.protocol.tuning import Tuning

    props = torch.cuda.get_device_properties(0)
    if not (wide_k_split(4096, 4096, props.multi_processor_count)
            and one_wave_glu(14336, 4096, props.multi_processor_count, props.shared_memory_per_block_optin)):
        pytest.skip("the one-wave rules do not apply on this GPU")
    model = tiny_models.build_model(tmp_path / "m", "llama", hidden=4096, layers=2, heads=32, kv_heads=8,
                                    head_dim=128, intermediate=14336, max_pos=2048, seed=5)
    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=1024, mode="full",
                              tuning=Tuning(head_pick=False)))  # exact head: every logit
    st = eng.decoder.fused_stages
    assert st.o.split == st.down.split == 2 and st.o.config == st.down.config == WIDE_K_TILE
    assert st.gate_up.glu and st.gate_up.config == ONE_WAVE_GLU_TILE
    prompt = [(13 * i + 5) % eng.cfg.vocab_size for i in range(300)]
    for mode in ("full", "piecewise", "eager"):
        c = greedy_steps_vs_reference(eng, mode, prompt, 16)
        assert c.agrees(eng.dtype), (mode, c)


@pytest.mark.parametrize("preset,preload", [("llama-3.2-1b", 1), ("llama-3.2-1b", 2), ("qwen2.5-1.5b", 1)])
def test_engine_with_wide_k_down_close_to_float32_reference(preset, preload, monkeypatch):
    """The down projection (1B: and o) on the wide-K tile, partial sums added by the next norm, in
    every graph mode: each greedy step's logits against the float32 reference over the same tokens."""
    from reference_steps import greedy_steps_vs_reference

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.kernels.gemv import WIDE_K_TILE
    from fgchat.engine.model import fused_step
    from fgchat.protocol.tuning import Tuning

    monkeypatch.setattr(fused_step, "PROJ_PRELOAD", preload)
    eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=1024, mode="full",
                              tuning=Tuning(head_pick=False)))  # exact head: every logit
    st = eng.decoder.fused_stages
    assert st.down.ours and st.down.split > 1 and st.down.config == WIDE_K_TILE
    if preset == "llama-3.2-1b":  # 2048 x 2048: o is mid-sized too
        assert st.o.split > 1 and st.o.config == WIDE_K_TILE
    prompt = [(13 * i + 5) % eng.cfg.vocab_size for i in range(300)]
    for mode in ("full", "piecewise", "eager"):
        c = greedy_steps_vs_reference(eng, mode, prompt, 16)
        assert c.agrees(eng.dtype), (mode, c)
