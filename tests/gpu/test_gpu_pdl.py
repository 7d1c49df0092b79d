"""Programmatic dependent launch between the step's Triton kernels (H200; skipped without CUDA).

Run on the GPU: pytest -m gpu tests/gpu/test_gpu_pdl.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H = 2048
LAYERS = 12


def _chain(h: torch.Tensor, norms: list[torch.Tensor], ws: list[torch.Tensor], pdl: bool) -> torch.Tensor:
    """norm -> projection -> silu-mul -> projection, LAYERS times: every kernel reads its
    predecessor's output, so a launch that ran ahead of its wait would read stale memory."""
    from fgchat.engine.kernels.fused import add_rms_norm, silu_mul
    from fgchat.engine.kernels.gemv import project, project_partials

    delta = None
    for i in range(LAYERS):
        h, x = add_rms_norm(h, delta, norms[i], 1e-5, pdl)
        gu = project(x, ws[2 * i], pdl=pdl)
        act = silu_mul(gu, pdl)
        # odd layers: split-K partial sums, added by the next norm
        delta = project_partials(act, ws[2 * i + 1], 2, pdl=pdl) if i % 2 else project(act, ws[2 * i + 1], pdl=pdl)
    return add_rms_norm(h, delta, norms[0], 1e-5, pdl)[1]


def _weights(rows: int):
    g = torch.Generator(device="cuda").manual_seed(3)
    norms = [(torch.rand(H, device="cuda", generator=g) + 0.5).bfloat16() for _ in range(LAYERS)]
    ws = []
    for _ in range(LAYERS):
        ws.append((torch.randn(2 * 1024, H, device="cuda", generator=g) * H**-0.5).bfloat16())
        ws.append((torch.randn(H, 1024, device="cuda", generator=g) * 1024**-0.5).bfloat16())
    return norms, ws


@pytest.mark.parametrize("rows", [1, 8])
def test_pdl_chain_in_a_graph_matches_plain_launches(rows):
    from fgchat.engine.kernels.pdl import supported

    assert supported(torch.device("cuda")), "the H200 supports programmatic dependent launch"
    norms, ws = _weights(rows)
    inp = torch.zeros(rows, H, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(inp, norms, ws, True)  # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(inp, norms, ws, True)
    g = torch.Generator(device="cuda").manual_seed(11)
    for rep in range(20):
        # new inputs every replay: a kernel that read before its predecessor finished would see
        # the previous replay's values and differ from the plain launches
        inp.copy_(torch.randn(rows, H, device="cuda", generator=g).bfloat16())
        graph.replay()
        want = _chain(inp.clone(), norms, ws, False)
        assert torch.equal(out, want), rep
        assert torch.equal(_chain(inp.clone(), norms, ws, True), want), rep  # eager PDL launches


@pytest.mark.parametrize("n,k", [(2048, 2048), (2048, 8192), (4096, 14336), (576, 1536)])
def test_split_k_projection_close_to_cublas(n, k):
    from fgchat.engine.kernels.gemv import pick_split, project_partials

    split = pick_split(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    assert split > 1
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(8, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    parts = project_partials(x, w, split, pdl=True)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    got = total.bfloat16().double()
    exact = x.double() @ w.double().T
    # float32 accumulation error (a bound proportional to sum |x w|) plus bf16 rounding of the sum;
    # a dropped or doubled slab would be off by a sizeable fraction of |exact| instead
    scale = x.double().abs() @ w.double().abs().T
    bound = 1e-5 * scale + torch.finfo(torch.bfloat16).eps * exact.abs()
    assert ((got - exact).abs() <= bound).all()
    ref_err = (F.linear(x, w).double() - exact).abs().mean()
    assert (got - exact).abs().mean() <= 1.5 * ref_err  # as accurate as cuBLAS on average


def test_lm_head_kernel_float32_logits_close_to_cublas():
    from fgchat.engine.kernels.gemv import project

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(8, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(128256, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    got = project(x, w, out_dtype=torch.float32, pdl=True)
    ref = F.linear(x, w).float()
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # bf16-rounded values
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    assert ((got - ref).abs() <= ulp * 1.01).all()  # accumulation order moves a value one ulp at most
    assert (got != ref).float().mean().item() < 0.05


@pytest.mark.parametrize("vocab", [128256, 49152])
def test_lm_head_greedy_pick_is_torch_argmax(vocab):
    from fgchat.engine.kernels.gemv import project_argmax

    g = torch.Generator(device="cuda").manual_seed(vocab)
    x = torch.randn(8, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    w[vocab - 1] = w[1000]  # a tie across programs: the first index must win
    x[3] = 0.0  # a row of ties only
    logits, tokens = project_argmax(x, w, pdl=True)
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    assert tokens[3].item() == 0


def test_engine_with_pdl_same_bits_as_without(tmp_path, monkeypatch):
    import tiny_models

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import SamplingParams

    model = tiny_models.head64_model(tmp_path / "m", max_pos=4096, seed=7)

    def engine(pdl: bool) -> Engine:
        """pdl False: built as on a device without PDL."""
        from fgchat.engine.kernels import pdl as pdl_mod
        from fgchat.engine.kernels.attention import triton_decode

        if not pdl:
            monkeypatch.setattr(pdl_mod, "supported", lambda device: False)
            monkeypatch.setattr(triton_decode, "pdl_supported", lambda device: False)
        try:
            return Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=2048,
                                       mode="full"))
        finally:
            monkeypatch.undo()

    on, off = engine(True), engine(False)
    assert on.decoder.pdl and on.attention.pdl and not off.decoder.pdl and not off.attention.pdl
    modes = on.info().available_modes  # the graph modes compared below (mega, where built, is not)
    assert all(modes.get(m) == "" for m in ("eager", "piecewise", "full")), on.info().notes
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, on.cfg.vocab_size, (9 + 37 * i,), generator=g).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7 * (i % 2), seed=i) for i in range(5)]
    for mode in ("eager", "piecewise", "full"):
        logits = []
        for eng in (off, on):
            eng.set_mode(mode)
            eng.keep_logits, eng.step_logits = True, []
            for p, sp in zip(prompts, params):
                eng.submit(p, sp)
            while eng.has_work():
                eng.step()
            logits.append([t.clone() for t in eng.step_logits])
        assert len(logits[0]) == len(logits[1]) > 0
        assert all(torch.equal(a, b) for a, b in zip(*logits)), mode
