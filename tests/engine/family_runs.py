"""Shared by the family models' fused-stage tests (test_qwen3_fused, test_gemma3_fused,
test_phi3_fused): a CPU engine on a tiny saved model, a prefill-then-decode run of a decoder over
its own cache, and the bf16 runs' comparison with float32's."""

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


def assert_bf16_near_float32(ref: tuple, plain: tuple, fused: tuple) -> None:
    """Each (tokens, logits) run in bf16, plain and fused, against the float32 run `ref`: the
    first tokens equal, and each step's fused logits no further from float32's than twice the
    plain stages' (plus 1% of the logits' scale), step by step while both runs' tokens agree with
    float32's (a near tie may turn later steps)."""
    (ref_toks, ref_logits), (plain_toks, plain_logits), (fused_toks, fused_logits) = ref, plain, fused
    assert [t[0] for t in fused_toks] == [t[0] for t in ref_toks]
    for j, (p, f, r) in enumerate(zip(plain_logits, fused_logits, ref_logits)):
        if any(t[:j] != u[:j] for t, u in zip(fused_toks + plain_toks, ref_toks + ref_toks)):
            break
        scale = float(r.abs().max())
        err_f, err_p = float((f - r).abs().max()), float((p - r).abs().max())
        print(f"bf16 step {j}: fused {err_f:.4f}, plain {err_p:.4f} from float32 (logits up to {scale:.2f})")
        assert err_f <= 2 * err_p + 0.01 * scale, (j, err_f, err_p, scale)


def worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest logit difference over the steps, relative to the logits' scale (at least 1)."""
    return max(float((g - w).abs().max()) / max(float(w.abs().max()), 1.0) for g, w in zip(got, want))


def assert_float32_equal(model_dir, plain: tuple, fused: tuple, prompts, steps: int, tol: float) -> None:
    """Float32 (tokens, logits) runs: the fused tokens equal the plain stages' and transformers'
    greedy ones, the logits within tol of the plain stages' (relative, worst)."""
    import tiny_models

    (want_toks, want), (got_toks, got) = plain, fused
    assert got_toks == want_toks
    assert worst(got, want) <= tol, worst(got, want)
    assert got_toks == tiny_models.hf_greedy(model_dir, [list(p) for p in prompts], steps + 1)


def assert_taken_out_fails(broken: tuple, want: torch.Tensor, name: str, tol: float) -> None:
    """A broken variant's prefill (decode's (tokens, [logits]) at 0 steps) is off `want`'s logits
    by more than 100 x tol of their scale (the comparison sees the op taken out)."""
    off = worst(broken[1], [want])
    print(f"{name}: logits off by {off:.3g} of their scale")
    assert off > 100 * tol
