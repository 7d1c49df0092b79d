"""Phi-3 on the fused stages (model.fused_step: partial RoPE in kernels.fused.rope_kv_write, which
rotates the first rotary_dim dims of each head; LongRoPE's per-position tables in decode and its
long rows for a prompt that ends past the original context in prefill), Triton kernels under the
interpreter on CPU: a tiny random Phi-3 built with transformers' classes (hidden 96 in 4 heads of 24, rotary 12:
neither half a power of two, so the kernel's masked lanes run; LongRoPE with an original context
of 32), one prompt past it and one below, prefilled and decoded a few greedy steps at batch 2 by a
fused decoder, against the plain family stages (model.family_stages) on the same weights and
transformers' float32 greedy tokens: float32 tokens equal and logits within float32 rounding; bf16
logits no further from float32 than the plain bf16 stages'. Full rotation instead of partial, and
the short factors only, each move the logits far past that tolerance. The batched and per-span
prefills pick the long rows per prompt as the single prefill does. Also the routing and mega's
refusal. GPU: tests/gpu/test_gpu_phi3_fused.py."""

from __future__ import annotations

import dataclasses
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
CUT = tiny_models.PHI3_ORIGINAL_CONTEXT
PROMPTS = ([(7 * j + 3) % 300 + 1 for j in range(CUT + 8)], [300, 12, 44, 45, 46, 8, 9])  # past the cut; below
SLOTS = (2, 5)
TOL = 1e-4


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return tiny_models.build_model(tmp_path_factory.mktemp("phi3_fused") / "phi3", "phi3", hidden=96, layers=2,
                                   seed=41)


def _engine(path, dtype: str):
    return family_runs.cpu_engine(path, dtype)


def _fused(eng, breaks=None, steps: int = STEPS, rows: int = len(PROMPTS)):
    """A fused decoder's run on the engine's weights over the first `rows` prompts (breaks(dec): an
    edit that takes an op out)."""
    dec, cache = family_runs.fused_decoder(eng)
    assert dec.family is None and dec.rope_long is not None and dec.rope_sets[0][0].shape[1] == 12
    if breaks is not None:
        breaks(dec)
    return family_runs.decode(dec, eng, cache, PROMPTS[:rows], SLOTS[:rows], steps)


@pytest.fixture(scope="module")
def float32_runs(phi3_dir):
    eng = _engine(phi3_dir, "float32")
    assert eng.decoder.family is not None and not eng.decoder.fused
    return eng, family_runs.decode(eng.decoder, eng, eng.cache, PROMPTS, SLOTS, STEPS), _fused(eng)


def test_fused_phi3_float32_equals_the_plain_stages_and_transformers(phi3_dir, float32_runs):
    _, plain, fused = float32_runs
    family_runs.assert_float32_equal(phi3_dir, plain, fused, PROMPTS, STEPS, TOL)


def _tables(dec, cfg) -> None:
    """The decoder's RoPE tables (decode and prefill) as cfg's, in the decoder's dtype."""
    from fgchat.engine.model.families import rope_tables

    cos, sin = (t.to(dec.dtype) for t in rope_tables(cfg, dec.max_context)[0])
    dec.rope_sets = [(cos, sin)]
    dec.rope_long = (torch.cat((cos, cos)), torch.cat((sin, sin)))


def _full_rotation(dec):
    """Every dim of a head rotated (the default frequencies over the whole head, no LongRoPE)."""
    _tables(dec, dataclasses.replace(dec.cfg, rotary_dim=None, rope_scaling=None))


def _short_only(dec):
    """LongRoPE's short factors at every position, in decode and in prefill."""
    far = dict(dec.cfg.rope_scaling, original_max_position_embeddings=10 * dec.max_context)
    _tables(dec, dataclasses.replace(dec.cfg, rope_scaling=far))


def _per_position_prefill(dec):
    """A prompt past the cut prefilled by the per-position table (short rows below the cut)."""
    dec.fused_stages.prefill_table_rows = lambda *args: None


@pytest.mark.parametrize("breaks", [_full_rotation, _short_only, _per_position_prefill])
def test_each_phi3_op_taken_out_fails_the_comparison(float32_runs, breaks):
    """The prefill of the prompt past the original context by each broken variant."""
    eng, (_, want), _ = float32_runs
    family_runs.assert_taken_out_fails(_fused(eng, breaks, steps=0, rows=1), want[0][:1], breaks.__name__, TOL)


def test_batched_and_per_span_prefills_pick_the_long_rows_per_prompt(float32_runs):
    """prefill_many_fused (host spans) and the batch route (device last rows, as its graphs run)
    give each prompt the last logits of its own prefill: the long rows for the prompt past the cut
    only."""
    from fgchat.engine.model.prefill import batch_bucket, prefill_batch, prefill_many_fused

    eng, (_, want), _ = float32_runs
    dec, cache = family_runs.fused_decoder(eng)
    prompts = [(torch.tensor(p), s) for p, s in zip(PROMPTS, SLOTS)]
    tb = batch_bucket([len(p) for p in PROMPTS], eng.max_context)
    assert tb is not None
    with torch.inference_mode():
        for got in (prefill_many_fused(dec, prompts, cache.k, cache.v),
                    prefill_batch(dec, prompts, tb, cache.k, cache.v)):
            assert family_runs.worst([torch.stack(got)], [want[0]]) <= TOL


@pytest.mark.skipif(not RNE, reason="no RNE patch")
def test_fused_phi3_bf16_logits_within_bf16_of_float32(phi3_dir, float32_runs):
    """bf16: each path's own greedy run compared step by step while its tokens agree with float32's."""
    eng = _engine(phi3_dir, "bfloat16")
    plain = family_runs.decode(eng.decoder, eng, eng.cache, PROMPTS, SLOTS, STEPS)
    family_runs.assert_bf16_near_float32(float32_runs[1], plain, _fused(eng))


def test_routing_puts_phi3_on_the_fused_stages():
    from fgchat.engine.model.config import parse_config
    from fgchat.engine.model.families import fused_note, fused_serves, uses_family_stages

    raw = dict(vocab_size=300, hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
               num_key_value_heads=1, rope_theta=10000.0, max_position_embeddings=512,
               architectures=["Phi3ForCausalLM"])
    phi3 = parse_config(dict(raw, partial_rotary_factor=0.75, original_max_position_embeddings=128,
                             rope_scaling={"type": "longrope", "short_factor": [1.0] * 12,
                                           "long_factor": [2.0] * 12}))
    assert phi3.rotary_dim == 24 and phi3.rope_scaling["rope_type"] == "longrope"
    for cfg in (phi3, parse_config(raw)):
        assert fused_serves(cfg) and fused_note(cfg) is None
        assert uses_family_stages(cfg) and not uses_family_stages(cfg, fused=True)  # reference / CPU: plain


def test_mega_kernel_refuses_partial_rope_with_its_reason(phi3_dir):
    from fgchat.engine.kernels.megakernel import DecodeLayers

    with pytest.raises(ValueError, match="partial RoPE"):
        DecodeLayers(*family_runs.fused_decoder(_engine(phi3_dir, "bfloat16")))
