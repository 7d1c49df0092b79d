"""Qwen3 on the fused stages (model.fused_step with the q/k norm in kernels.fused.rope_kv_write;
Triton kernels under the interpreter on CPU): a tiny random Qwen3 built with transformers'
classes, prefilled and decoded a few greedy steps at batch 2 by a fused decoder, against the plain
family stages (model.family_stages) on the same weights: float32 tokens equal and logits within
float32 rounding; bf16 logits no further from the float32 ones than the plain bf16 stages' (within
bf16 rounding). Also: the routing (families.uses_family_stages / fused_note), and the mega kernel
refusing the q/k norm with its reason. The GPU runs: tests/gpu/test_gpu_qwen3_fused.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")
pytest.importorskip("transformers")

import family_runs  # noqa: E402
import interpreter_rounding  # noqa: E402
import tiny_models  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU file covers CUDA")
RNE = interpreter_rounding.install()
STEPS = 3
PROMPTS = ([5, 17, 33, 90, 201, 7], [300, 12, 44, 45, 46, 8, 9, 250, 3])
SLOTS = (2, 5)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny_models.build_model(tmp_path_factory.mktemp("qwen3_fused") / "qwen3", "qwen3", layers=2, seed=31)


def _engine(path, dtype: str):
    return family_runs.cpu_engine(path, dtype)


def _decode(dec, eng, cache, steps: int = STEPS) -> tuple[list[list[int]], list[torch.Tensor]]:
    return family_runs.decode(dec, eng, cache, PROMPTS, SLOTS, steps)


def _both(path, dtype: str, fused: bool = True):
    """(plain, fused) decodes of the same weights: the engine's own decoder (CPU: the plain family
    stages) and a fused decoder beside it, on caches of their own (fused False: the plain only)."""
    eng = _engine(path, dtype)
    assert eng.decoder.family is not None and not eng.decoder.fused
    plain = _decode(eng.decoder, eng, eng.cache)
    if not fused:
        return plain, None
    dec, cache = family_runs.fused_decoder(eng)
    assert dec.family is None and dec.fused_stages.qk_norms is not None
    return plain, _decode(dec, eng, cache)


def test_fused_qwen3_float32_equals_the_plain_family_stages(qwen3_dir):
    (want_toks, want), (got_toks, got) = _both(qwen3_dir, "float32")
    assert got_toks == want_toks
    for g, w in zip(got, want):
        scale = float(w.abs().max())
        assert float((g - w).abs().max()) <= 1e-4 * max(scale, 1.0), float((g - w).abs().max())


@pytest.mark.skipif(not RNE, reason="no RNE patch")
def test_fused_qwen3_bf16_logits_within_bf16_of_float32(qwen3_dir):
    """bf16: each step fed the float32 run's tokens would diverge on near ties; instead each
    path's own greedy run is compared, step by step while its tokens agree with float32's."""
    ref, _ = _both(qwen3_dir, "float32", fused=False)
    family_runs.assert_bf16_near_float32(ref, *_both(qwen3_dir, "bfloat16"))


def test_routing_puts_qwen3_on_the_fused_stages_and_the_others_on_the_plain(tmp_path):
    from fgchat.engine.model.config import parse_config
    from fgchat.engine.model.families import fused_note, fused_serves, uses_family_stages

    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512)
    qwen3 = parse_config(dict(base, architectures=["Qwen3ForCausalLM"]))
    gemma = parse_config(dict(base, architectures=["Gemma3ForCausalLM"], sliding_window=8,
                              final_logit_softcapping=30.0))  # a cap: plain (test_gemma3_fused)
    llama = parse_config(dict(base, architectures=["LlamaForCausalLM"]))
    assert fused_serves(qwen3) and not fused_serves(gemma) and not fused_serves(llama)
    assert uses_family_stages(qwen3) and not uses_family_stages(qwen3, fused=True)  # reference / CPU: plain
    assert uses_family_stages(gemma) and uses_family_stages(gemma, fused=True)
    assert fused_note(qwen3) is None and fused_note(llama) is None
    assert "plain torch stages" in fused_note(gemma)


def test_mega_kernel_refuses_the_qk_norm_with_its_reason(qwen3_dir):
    from fgchat.engine.kernels.megakernel import DecodeLayers

    with pytest.raises(ValueError, match="q/k norm"):
        DecodeLayers(*family_runs.fused_decoder(_engine(qwen3_dir, "bfloat16")))
