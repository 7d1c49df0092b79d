"""Projection weight tiles by TMA (Hopper bulk copies) on the GPU: against a float32 product, against
the same tiles by pointer loads, through the fast launcher and inside a captured graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _needs_tma():
    from fgchat.engine.kernels import tma

    if not tma.available(torch.device("cuda")):
        pytest.skip("the GPU has no TMA (sm_90+)")


def _inputs(m: int, rows: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(rows, k, device="cuda", generator=g) * 0.02).bfloat16()
    return x, w


# (role, N, K): Llama-3.2-1B qkv, o and gate/up, Llama-3.1-8B qkv, o, gate/up and down
SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 8192, 2048), ("qkv", 6144, 4096),
          ("o", 4096, 4096), ("gate_up", 14336, 4096), ("down", 4096, 14336)]


def _tiles(role: str, n: int, k: int):
    """(TMA tile, the same tile by pointer loads, split): the engine's TMA tile for o (its short
    slices), else the shape rule's tile with TMA on."""
    from fgchat.engine.kernels import gemv

    glu = role == "gate_up"
    split = 1
    if role in ("o", "down"):
        split = gemv.pick_split(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    bulk = gemv.short_slice_config(n, k, split) if role == "o" else None
    bulk = bulk or dataclasses.replace(gemv.pick_config(n, k, glu), tma=True)
    return bulk, dataclasses.replace(bulk, tma=False), split


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("role,n,k", SHAPES)
def test_tma_projection_close_to_float32_and_to_pointer_loads(role, n, k, m):
    _needs_tma()
    from fgchat.engine.kernels import gemv

    glu = role == "gate_up"
    x, w = _inputs(m, 2 * n if glu else n, k, n + k + m)
    bulk, pointer, split = _tiles(role, n, k)
    ref = x.float() @ w.float().T
    if glu:
        got, same = gemv.project_glu(x, w, bulk, pdl=True), gemv.project_glu(x, w, pointer, pdl=True)
        g, u = ref.chunk(2, dim=1)
        ref = F.silu(g) * u
        tol = ref.abs() * 2**-6 + 2e-3
    elif split > 1:
        got = gemv.project_partials(x, w, split, bulk, pdl=True).sum(0)
        same = gemv.project_partials(x, w, split, pointer, pdl=True).sum(0)
        tol = ref.abs() * 2**-7 + 1e-3
    else:
        got, same = gemv.project(x, w, bulk, pdl=True), gemv.project(x, w, pointer, pdl=True)
        tol = ref.abs() * 2**-7 + 1e-3
    assert ((got.float() - ref).abs() <= tol).all()
    assert ((got.float() - same.float()).abs() <= tol).all()
    one = gemv.project_glu(x[:1].contiguous(), w, bulk) if glu else gemv.project(x[:1].contiguous(), w, bulk)
    if role not in ("o", "down"):
        assert torch.equal(one[0], got[0])  # a row's result does not depend on the batch


def test_tma_launch_takes_the_fast_path_with_the_plain_bits():
    _needs_tma()
    from fgchat.engine.kernels import gemv
    from fgchat.engine.kernels.launch import fast

    x, w = _inputs(2, 6144, 4096, 5)
    bulk = _tiles("qkv", 6144, 4096)[0]
    launcher = fast(gemv._proj_kernel)
    first = gemv.project(x, w, bulk)
    before = launcher.fast_launches
    again = gemv.project(x, w, bulk)
    assert launcher.fast_launches == before + 1
    assert torch.equal(first, again)


def test_tma_projection_replays_in_a_graph_with_new_inputs():
    """The descriptor (the weight's address) is captured by value; inputs change between replays."""
    _needs_tma()
    from fgchat.engine.kernels import gemv

    x, w = _inputs(4, 8192 * 2, 2048, 9)
    bulk = _tiles("gate_up", 8192, 2048)[0]
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv.project_glu(static_x, w, bulk, pdl=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.project_glu(static_x, w, bulk, pdl=True)
    for seed in (1, 2):
        static_x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv.project_glu(static_x, w, bulk, pdl=True))


def test_engine_with_tma_matches_a_float32_reference(tmp_path):
    """FGCHAT_TMA=1 on a model with Llama-3.2-1B's layer shapes (its o projection split in short
    slices, where pointer loads take another split, so other sums): in every graph mode each
    decode step's logits are as close to transformers in float32 on the same prefix as
    transformers' own bf16 is (or within 4 bf16 ulps), and the greedy token is the reference's
    wherever its top two are further apart than transformers' own bf16 error could swap."""
    _needs_tma()
    transformers = pytest.importorskip("transformers")
    import tiny_models
    from reference_steps import decode_keeping_logits, steps_agree_with_hf

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.kernels import gemv
    from fgchat.protocol.tuning import Tuning

    model = tiny_models.build_model(tmp_path / "m", "llama", hidden=2048, layers=2, heads=32, kv_heads=8,
                                    head_dim=64, intermediate=8192, max_pos=2048, seed=3)
    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=1024, mode="full",
                              tuning=Tuning(tma=True)))
    assert eng.decoder._fused.o.config == gemv.SHORT_SLICE
    ref, ref_half = (transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dt).cuda().eval()
                     for dt in (torch.float32, torch.bfloat16))
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, eng.cfg.vocab_size, (37,), generator=g).tolist()
    for mode in ("eager", "piecewise", "full"):
        tokens, steps = decode_keeping_logits(eng, mode, prompt)
        assert steps_agree_with_hf(ref, prompt, tokens, steps, mode, ref_half) >= 4, mode
