"""FGCHAT_PIECEWISE_O on the GPU: the o projection launched with the attention (outside the
piecewise graphs, into a buffer of fixed address) gives every mode the same bits as without it."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_modes_with_the_o_projection_beside_attention_keep_their_bits(tmp_path):
    import tiny_models
    from reference_steps import decode_keeping_logits

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    model = tiny_models.build_model(tmp_path / "m", "llama", hidden=2048, layers=2, heads=32, kv_heads=8,
                                    head_dim=64, intermediate=8192, max_pos=2048, seed=9)
    engines = {on: Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=1024,
                                       mode="full", tuning=Tuning(piecewise_o=on))) for on in (False, True)}
    assert engines[True].decoder.o_with_attention and not engines[False].decoder.o_with_attention
    modes = engines[True].info().available_modes  # the self-check passed for every graph mode
    assert all(modes.get(m) == "" for m in ("eager", "piecewise", "full")), engines[True].info().notes
    prompt = torch.randint(3, engines[True].cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    for mode in ("eager", "piecewise", "full"):
        got_tokens, got = decode_keeping_logits(engines[True], mode, prompt)
        want_tokens, want = decode_keeping_logits(engines[False], mode, prompt)
        assert got_tokens == want_tokens, mode
        assert all(torch.equal(a, b) for a, b in zip(got, want)), mode
