"""The unfiltered sampled pick's Triton kernels on the GPU against the torch composition, which is
the reference (H200; skipped without CUDA). Run: pytest -m gpu tests/gpu/test_gpu_sampling.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.kernels import sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _lanes(b: int, g: torch.Generator):
    t = torch.rand(b, device="cuda", generator=g) * 1.5 + 0.05
    t[0] = 0.0  # a greedy lane in every batch
    seeds = torch.randint(0, 2**62, (b,), device="cuda", generator=g)
    return t, seeds


@pytest.mark.parametrize("vocab", [49152, 128256, 151936])
def test_the_kernels_pick_the_torch_tokens_bit_for_bit(vocab):
    """Every batch size, logits rounded through bf16 as the LM head gives them (many exact ties
    between ids: the greedy lane must still pick the first), 40 positions each."""
    g = torch.Generator(device="cuda").manual_seed(vocab)
    for b in range(1, 9):
        t, seeds = _lanes(b, g)
        ones, zeros = torch.ones(b, device="cuda"), torch.zeros(b, dtype=torch.int64, device="cuda")
        for pos in range(40):
            logits = (torch.randn(b, vocab, device="cuda", generator=g) * 4).bfloat16().float()
            positions = torch.full((b,), 100 + pos, device="cuda") + torch.arange(b, device="cuda")
            args = (logits, t, ones, zeros, seeds, positions)
            fast = sampling.sample(*args, filtered=False)
            ref = sampling.sample(*args, filtered=False, use_triton=False)
            sorted_ref = sampling.sample(*args, filtered=True)  # the sort path, nothing filtered
            assert torch.equal(fast, ref), (b, pos, fast, ref)
            if not torch.equal(fast, sorted_ref):  # the scores of both picks, for the report
                scaled = logits / torch.where(t > 0, t, 1.0)[:, None]
                score = scaled - torch.log(-torch.log(sampling.uniform_noise(seeds, positions, vocab)))
                lane = int((fast != sorted_ref).nonzero()[0])
                pytest.fail(f"b {b} pos {pos} lane {lane} T {float(t[lane])}: {int(fast[lane])} scores "
                            f"{float(score[lane, fast[lane]])!r}, sorted path {int(sorted_ref[lane])} scores "
                            f"{float(score[lane, sorted_ref[lane]])!r}")
            assert fast[0] == torch.argmax(logits[0])


def test_the_pick_replays_inside_a_cuda_graph():
    b, vocab = 8, 128256
    g = torch.Generator(device="cuda").manual_seed(1)
    t, seeds = _lanes(b, g)
    ones, zeros = torch.ones(b, device="cuda"), torch.zeros(b, dtype=torch.int64, device="cuda")
    logits = torch.randn(b, vocab, device="cuda", generator=g)
    positions = torch.arange(b, device="cuda")
    sampling.sample(logits, t, ones, zeros, seeds, positions, filtered=False)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.sample(logits, t, ones, zeros, seeds, positions, filtered=False)
    for step in range(20):
        logits.copy_(torch.randn(b, vocab, device="cuda", generator=g) * 3)
        positions.add_(1)
        graph.replay()
        ref = sampling.sample(logits, t, ones, zeros, seeds, positions, filtered=False, use_triton=False)
        assert torch.equal(out, ref), step


@pytest.mark.parametrize("vocab,hidden", [(128256, 2048), (49152, 576)])
def test_the_lm_head_epilogue_picks_the_torch_tokens(vocab, hidden):
    """The sampled pick inside the LM head kernel (V37) at real shapes, bf16 weights: per row the
    token sampling.sample(filtered=False) computes with torch ops on the same float32 logits."""
    from fgchat.engine.kernels import gemv

    g = torch.Generator(device="cuda").manual_seed(vocab)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16()
    for b in range(1, 9):
        t, seeds = _lanes(b, g)
        ones, zeros = torch.ones(b, device="cuda"), torch.zeros(b, dtype=torch.int64, device="cuda")
        for pos in range(10):
            x = (torch.randn(b, hidden, device="cuda", generator=g) * 3).bfloat16()
            positions = torch.full((b,), 7 + pos, device="cuda") + torch.arange(b, device="cuda")
            logits, tokens = gemv.project_argmax(x, w, sample=(t, seeds, positions))
            ref = sampling.sample(logits, t, ones, zeros, seeds, positions, filtered=False, use_triton=False)
            assert torch.equal(tokens, ref), (b, pos, tokens, ref)


def test_the_engine_samples_the_same_tokens_with_the_pick_in_the_lm_head(tmp_path, monkeypatch):
    """Whole engine, every mode, T 0.7 without filters: the tokens with the pick in the LM head
    equal those of the separate sampling kernels after it (the head given no sample arguments)."""
    import tiny_models

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.fused_step import FusedStages
    from fgchat.protocol.events import RequestFinished, SamplingParams

    path = tiny_models.build_model(tmp_path / "m", "llama", hidden=512, layers=2, heads=8, kv_heads=2,
                                   head_dim=64, intermediate=1024, max_pos=2048, seed=5)
    outs = {}
    head = FusedStages.head
    for on in (True, False):
        if not on:  # sampled steps: logits from the head, the pick in the sampling kernels
            monkeypatch.setattr(FusedStages, "head", lambda self, st, greedy, sample=None: head(self, st, greedy))
        eng = Engine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", max_context=1024,
                                  mode="full"))
        assert eng.decoder._fused is not None
        for mode, temp in (("eager", 0.7), ("piecewise", 0.7), ("full", 0.7), ("full", 0.0)):
            eng.set_mode(mode)
            rids = [eng.submit(list(range(5 + i, 25 + i)), SamplingParams(temperature=temp, seed=3 + i,
                                                                        max_tokens=24, ignore_eos=True))
                    for i in range(5)]
            events = []
            while eng.has_work():
                events += eng.step()
            done = {e.summary.request_id: e.summary.token_ids for e in events if isinstance(e, RequestFinished)}
            outs[(on, mode, temp)] = [done[r] for r in rids]
    sampled = outs[(True, "full", 0.7)]
    assert outs[(True, "eager", 0.7)] == outs[(True, "piecewise", 0.7)] == sampled == outs[(False, "full", 0.7)]
    assert outs[(False, "eager", 0.7)] == sampled
    assert sampled != outs[(True, "full", 0.0)]  # the lanes really sampled
