"""CPU projections through oneDNN's packed weights (model.cpu_linear): the same tokens and logits
as F.linear (bf16 bit for bit, float32 up to the sum order), the qkv bias included; declined over
its memory budget and where the packed product disagrees."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.model import cpu_linear
from fgchat.engine.model.cpu_linear import PackedProjections
from fgchat.protocol.events import RequestFinished, SamplingParams

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _run(path, dtype: str) -> tuple[Engine, list[list[int]], torch.Tensor]:
    eng = Engine(EngineConfig(model=str(path), device="cpu", dtype=dtype, max_context=256))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 29)]
    for p in prompts:
        eng.submit(p, SamplingParams(max_tokens=12, ignore_eos=True))
    done = {e.summary.request_id: e.summary.token_ids for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    logits = eng.decoder.prefill(torch.tensor(prompts[1]), 0, eng.cache.k, eng.cache.v, all_logits=True)
    return eng, [done[k] for k in sorted(done)], logits


def _packs_bf16() -> bool:
    try:
        cpu_linear.pack(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: a qkv bias
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_projections_match_f_linear(tiny_model_dirs, family, dtype, monkeypatch):
    eng, tokens, logits = _run(tiny_model_dirs[family], dtype)
    if dtype == "bfloat16" and not _packs_bf16():  # e.g. AVX2 alone: the decoder keeps F.linear
        assert eng.decoder._packed is None
        pytest.skip("oneDNN packs no bf16 weights on this CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    assert eng.decoder._packed is not None  # the packed path ran
    # where oneDNN declines the packed copies: F.linear
    monkeypatch.setattr(PackedProjections, "prepare", classmethod(lambda cls, weights: None))
    plain, want_tokens, want_logits = _run(tiny_model_dirs[family], dtype)
    assert plain.decoder._packed is None
    assert tokens == want_tokens
    if dtype == "bfloat16":
        assert torch.equal(logits, want_logits)
    else:
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_prepare_declines_over_budget_and_on_a_wrong_product(tiny_llama, monkeypatch):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=64))
    w = eng.model.weights
    need = sum(t.numel() * t.element_size() for lw in w.layers for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
    assert PackedProjections.prepare(w, budget_bytes=need) is not None
    assert PackedProjections.prepare(w, budget_bytes=need - 1) is None
    real = cpu_linear.packed_linear
    monkeypatch.setattr(cpu_linear, "packed_linear", lambda x, p, b=None: real(x, p, b) * 1.001)
    assert PackedProjections.prepare(w, budget_bytes=need) is None
