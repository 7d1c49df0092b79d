"""The verification step (B x (k + 1) rows, several on one slot) through the fused Triton stages
under Triton's interpreter, against one-token steps of the plain torch decoder in float32: the
step inputs, the K/V writes in the stages (also where RoPE would run inside attention) and the
LM head past 16 rows. The Triton attention kernel itself needs CUDA: tests/gpu/test_gpu_speculate.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rope_in_attention", [False, True])
def test_fused_verification_rows_are_plain_one_token_steps(tiny_llama, rope_in_attention):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.speculate.verify import block_rows
    from fgchat.engine.step import StepProgram, Variant
    from fgchat.protocol.tuning import Tuning

    eng = Engine(EngineConfig(model=str(tiny_llama), device=DEV, max_context=96, dtype="float32",
                              tuning=Tuning(head_pick=False)))
    dec = Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True)
    if DEV == "cpu":
        # the stages leave K/V to the attention call: a verification must write them itself
        dec.fused_stages.rope_in_attention = rope_in_attention
    elif rope_in_attention:
        pytest.skip("on CUDA the engine's own binding decides")
    fused = StepProgram(dec, eng.cache, eng.bufs, eng.attention)
    cache, prog = eng.cache, eng.program
    lengths = [30, 4, 61, 12]
    slots = [2, 0, 6, 5]
    g = torch.Generator(device=DEV).manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g, device=DEV))
    drafts = [[11, 12, 13, 14], [], [21, 22], [31, 32, 33, 34]]  # block 5: 20 rows
    lasts = [5, 6, 7, 8]
    saved = cache.all.clone()
    with torch.inference_mode():
        want = []
        for n, s, last, d in zip(lengths, slots, lasts, drafts):
            for j, tok in enumerate([last] + d):
                prog.bufs.stage([tok], [n - 1 + j], [s], [0.0], [1.0], [0], [0])
                prog.max_len_hint = n + j
                want.append(prog.run_eager(1, Variant.SAMPLED).logits[0].clone())
        cache.all.copy_(saved)
        for n, s in zip(lengths, slots):
            cache.all[:, s, n - 1:] = float("nan")  # written by the verification before any read
        ids, pos, rows_slots, block = block_rows(lasts, drafts, lengths, slots, eng.max_context)
        k = len(ids)
        fused.bufs.stage(ids, pos, rows_slots, [0.0] * k, [1.0] * k, [0] * k, [0] * k)
        fused.max_len_hint = max(pos) + 1
        out = fused.run_eager(4, Variant.SAMPLED, block)
    real = [i * block + j for i, d in enumerate(drafts) for j in range(len(d) + 1)]
    assert block == 5 and k == 20
    for r, w in zip(real, want):
        assert torch.isfinite(out.logits[r]).all(), r
        assert torch.allclose(out.logits[r], w, rtol=1e-3, atol=1e-3), (r, float((out.logits[r] - w).abs().max()))
    assert [int(out.tokens[r]) for r in real] == [int(w.argmax()) for w in want]
