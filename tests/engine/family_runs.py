"""Shared by the family models' fused-stage tests (test_qwen3_fused, test_gemma3_fused): a CPU
engine on a tiny saved model, and a prefill-then-decode run of a decoder over its own cache."""

from __future__ import annotations

import torch


def cpu_engine(path, dtype: str, max_context: int = 64):
    """The engine on CPU without the int8 head pick (every logit exact)."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    return Engine(EngineConfig(model=str(path), device="cpu", max_context=max_context, dtype=dtype,
                               tuning=Tuning(head_pick=False)))


def fused_decoder(eng):
    """A fused decoder on the engine's weights and a fresh KV cache of its own."""
    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.model.decoder import Decoder

    return (Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True),
            KVCache(eng.cfg, eng.max_context, eng.device, eng.dtype))


def decode(dec, eng, cache, prompts, slots, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill each prompt into its slot, then `steps` greedy steps of all rows together: the
    tokens per row and each step's logits [B, V] (the prefills' last logits first)."""
    from fgchat.engine.step import StepBuffers, StepProgram, Variant

    b = len(prompts)
    bufs = StepBuffers(eng.device, eng.cfg.num_heads, eng.cfg.head_dim, eng.dtype)
    prog = StepProgram(dec, cache, bufs, eng.attention)
    with torch.inference_mode():
        first = torch.stack([dec.prefill(torch.tensor(p), s, cache.k, cache.v) for p, s in zip(prompts, slots)])
        logits = [first]
        toks = [[int(t)] for t in first.argmax(dim=1)]
        lens = [len(p) for p in prompts]
        for j in range(steps):
            bufs.stage([t[-1] for t in toks], [n + j for n in lens], list(slots), [0.0] * b, [1.0] * b,
                       [0] * b, [0] * b)
            prog.max_len_hint = max(lens) + j + 1
            out = prog.run_eager(b, Variant.GREEDY)
            logits.append(out.logits.float().clone())
            for row, t in zip(toks, out.tokens.tolist()):
                row.append(int(t))
    return toks, logits
