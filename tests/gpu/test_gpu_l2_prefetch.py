"""L2 weight prefetch beside attention in full graphs (sm_90+; skipped without CUDA).

Run on the H200: pytest -m gpu tests/gpu/test_gpu_l2_prefetch.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.protocol.tuning import Tuning

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _needs_sm90():
    from fgchat.engine.kernels import l2_prefetch

    if not l2_prefetch.supported(torch.device("cuda")):
        pytest.skip("bulk L2 prefetch needs sm_90+")


def test_prefetch_runs_eagerly_and_in_a_graph_and_writes_nothing():
    _needs_sm90()
    from fgchat.engine.kernels import l2_prefetch as lp

    a = torch.randn(4096, 2048, device="cuda").bfloat16()  # 16 MiB
    b = torch.randn(1000, 3000, device="cuda").bfloat16()  # not a whole number of chunks
    c = torch.randn(2048, 2048, device="cuda").bfloat16()
    before = (a.clone(), b.clone(), c.clone())
    ranges = lp.plan([a, b, c], 40 * 2**20)  # three ranges: two launches
    assert [r.chunks for r in ranges] == [4096, 6_000_000 // lp.CHUNK, 2048]
    ranges.append(lp.leading_tiles(c, 256, 2 * 2**20))  # two 256-column tiles (1 MiB each) of each of c's rows: one launch more
    assert ranges[-1] == lp.Rows(c.data_ptr(), 2048, 4096, 1024)
    lp.issue(ranges)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        lp.issue(ranges)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip((a, b, c), before))


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def _engine(model, budget_mb: int, monkeypatch, **tuning):
    """A full-mode engine on `model` whose L2 prefetch budget is budget_mb."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model import fused_step

    monkeypatch.setattr(fused_step, "L2_PREFETCH_MB", budget_mb)
    try:
        return Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=2048,
                                   mode="full", tuning=Tuning(**tuning)))
    finally:
        monkeypatch.undo()


def test_graphs_prefetch_beside_each_attention_with_the_same_bits(tmp_path, monkeypatch):
    _needs_sm90()
    import tiny_models

    from fgchat.protocol.events import Mode, SamplingParams

    model = tiny_models.head64_model(tmp_path / "m", max_pos=4096, seed=7)

    # the tiny layers fit the budget whole, so piecewise graphs prefetch unless told not to
    on = _engine(model, 64, monkeypatch, piecewise_prefetch=False)
    off, pw = _engine(model, 0, monkeypatch), _engine(model, 64, monkeypatch)
    assert not on.decoder.piecewise_prefetch and pw.decoder.piecewise_prefetch
    assert on.decoder.side_work(2) is not None and off.decoder.side_work(2) is None
    assert on.info().available_modes == {"eager": "", "piecewise": "", "full": "", "mega": ""}, on.info().notes
    names = _kernel_names(lambda: on.modes.run(Mode.FULL, 2, False))
    if not names:
        pytest.skip("the profiler records no kernels of graph replays here")
    # o, gate/up, down and the next qkv fit the budget: two launches (two ranges each at most) per layer
    assert sum("_prefetch_kernel" in n for n in names) == 2 * on.cfg.num_layers, names
    assert not any("_prefetch_kernel" in n for n in _kernel_names(lambda: off.modes.run(Mode.FULL, 2, False)))
    # piecewise: none when switched off; by default here the same launches inside its pieces
    for eng in (on, pw):
        eng.modes.run(Mode.PIECEWISE, 2, False)  # captured outside the profiled replays
    assert not any("_prefetch_kernel" in n for n in _kernel_names(lambda: on.modes.run(Mode.PIECEWISE, 2, False)))
    pw_names = _kernel_names(lambda: pw.modes.run(Mode.PIECEWISE, 2, False))
    assert sum("_prefetch_kernel" in n for n in pw_names) == 2 * pw.cfg.num_layers, pw_names

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, on.cfg.vocab_size, (11 + 41 * i,), generator=g).tolist() for i in range(4)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    _same_logits([(off, "eager"), (off, "full"), (on, "full"), (on, "piecewise"), (pw, "piecewise"), (pw, "full")],
                 prompts, params)


def _same_logits(runs_of: list, prompts: list[list[int]], params: list) -> None:
    """Every (engine, mode) decodes `prompts` together to the same logits at every step."""
    runs = []
    for eng, mode in runs_of:
        eng.set_mode(mode)
        eng.keep_logits, eng.step_logits = True, []
        for p, sp in zip(prompts, params):
            eng.submit(p, sp)
        while eng.has_work():
            eng.step()
        runs.append([t.clone() for t in eng.step_logits])
    assert len(runs[0]) > 0
    for r in runs[1:]:
        assert len(r) == len(runs[0]) and all(torch.equal(a, b) for a, b in zip(r, runs[0]))


def test_leading_gate_up_tiles_in_a_full_graph_change_no_bit(tmp_path, monkeypatch):
    """Tuning.l2_prefetch_lead: a gate/up of 16 MiB that an 8 MiB budget cannot hold gets its
    leading K tiles (every row's first 256 columns each) prefetched after o, within LEAD_BUDGET_MB
    (at most half of K: two); full mode gives the same bits with them and without, and as eager."""
    _needs_sm90()
    import tiny_models

    from fgchat.engine.kernels import l2_prefetch as lp
    from fgchat.protocol.events import SamplingParams

    model = tiny_models.build_model(tmp_path / "m", "llama", hidden=1024, layers=2, heads=16, kv_heads=4,
                                    head_dim=64, intermediate=4096, max_pos=2048, seed=4)

    on, off = (_engine(model, 8, monkeypatch, l2_prefetch_lead=lead) for lead in (True, False))
    lw = on.decoder.w.layers[0]
    assert on.decoder.fused_stages.lead[0] == lp.Rows(lw.w_gate_up.data_ptr(), 8192, 2048, 2 * 512)
    assert off.decoder.fused_stages.lead is None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, on.cfg.vocab_size, (17 + 29 * i,), generator=g).tolist() for i in range(3)]
    _same_logits([(off, "eager"), (off, "full"), (on, "full")], prompts,
                 [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts))
