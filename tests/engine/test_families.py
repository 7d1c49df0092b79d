"""Qwen3, Gemma 3 and Phi-3 (model.families) on CPU in float32: greedy tokens and logits against
transformers' own classes on tiny random models, batch 1 and 2, Gemma 3 past its sliding window,
Phi-3 with LongRoPE below and past its original context; the float32 reference; config parsing."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.model.config import parse_config
from fgchat.protocol.errors import ModelLoadError
from fgchat.protocol.events import RequestFinished, SamplingParams

transformers = pytest.importorskip("transformers")

# prompt lengths: Gemma's window is 8 (every prompt but the first passes it); Phi-3's original
# context is 32: 5 and 7 tokens stay below it for all 24 new tokens, 40 starts past it (a reply
# that crosses it is not compared: transformers then recomputes the whole sequence, see families)
PROMPTS = {"qwen3": (5, 11, 19), "gemma3": (5, 13, 30), "phi3": (5, 7, 40)}
NEW = 24


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: tiny_models.build_model(root / f, f, layers=3, seed=11 + i)
            for i, f in enumerate(tiny_models.NEW_FAMILIES)}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _hf_greedy(ref, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", tiny_models.NEW_FAMILIES)
def test_greedy_tokens_and_logits_match_transformers(family_dirs, family):
    path = family_dirs[family]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_context=256))
    prompts = [_prompt(n, 100 + n, eng.cfg.vocab_size) for n in PROMPTS[family]]
    want = [_hf_greedy(ref, p) for p in prompts]
    for p, w in zip(prompts, want):  # batch 1
        rid = eng.submit(p, SamplingParams(max_tokens=NEW, ignore_eos=True))
        got = {e.summary.request_id: e.summary.token_ids for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        assert got[rid] == w, (family, len(p))
    # batch 2: two prompts admitted and decoded together
    rids = [eng.submit(p, SamplingParams(max_tokens=NEW, ignore_eos=True)) for p in prompts[1:]]
    got = {e.summary.request_id: e.summary.token_ids for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    assert [got[r] for r in rids] == want[1:]
    # every position's logits of the longest sequence, from one prefill
    full = prompts[-1] + want[-1]
    with torch.no_grad():
        hf = ref(torch.tensor([full])).logits[0]
    ours = eng.decoder.prefill(torch.tensor(full), 0, eng.cache.k, eng.cache.v, all_logits=True)
    torch.testing.assert_close(ours, hf, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", tiny_models.NEW_FAMILIES)
def test_float32_reference_matches_transformers_and_the_decode_step(family_dirs, family):
    """model.reference on these families: its logits equal transformers'; a decode step of the
    engine equals reference_decode_step over the same cache (Gemma: past its window)."""
    from fgchat.engine.model.reference import reference_decode_step, reference_logits
    from fgchat.protocol.tuning import Tuning

    path = family_dirs[family]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_context=256, tuning=Tuning(head_pick=False)))
    dec = eng.decoder
    ids = _prompt(21, 7, eng.cfg.vocab_size)
    with torch.no_grad():
        hf = ref(torch.tensor([ids])).logits[0]
    got = reference_logits(eng.cfg, dec.w, torch.tensor(ids), dec.cos, dec.sin, dec.scale)
    torch.testing.assert_close(got, hf, rtol=1e-4, atol=1e-4)
    eng.submit(ids, SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()  # the prefill and its first token
    eng.step()  # one decode step
    seq = eng.scheduler.running[0]
    pos = len(ids) + len(seq.output_ids) - 2
    step = reference_decode_step(eng.cfg, dec.w, [seq.output_ids[-2]], [pos], [seq.slot], eng.cache.k,
                                 eng.cache.v, dec.cos, dec.sin, dec.scale)
    torch.testing.assert_close(eng.last_logits[:1], step, rtol=1e-4, atol=1e-4)


def _raw(arch: str, **kw) -> dict:
    base = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    return {**base, **kw}


def test_gemma3_legacy_config_takes_the_pattern_and_local_base():
    cfg = parse_config(_raw("Gemma3ForCausalLM", head_dim=16, sliding_window=512, sliding_window_pattern=6,
                            rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=256,
                            rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert cfg.layer_windows == (512, 512, 512, 512, 512, 0)
    assert cfg.sliding_window is None  # a window of some layers does not cap the context
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert cfg.attn_scale == 256 ** -0.5 and cfg.gemma_norms and cfg.activation == "gelu_tanh"


def test_phi3_su_scaling_is_longrope_with_its_attention_factor():
    import math

    cfg = parse_config(_raw("Phi3ForCausalLM", partial_rotary_factor=0.75, max_position_embeddings=131072,
                            original_max_position_embeddings=4096,
                            rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}))
    assert cfg.rotary_dim == 12 and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    with pytest.raises(ModelLoadError, match="short_factor must be 6"):
        parse_config(_raw("Phi3ForCausalLM", partial_rotary_factor=0.75, original_max_position_embeddings=4096,
                          rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0] * 6}))


def test_unsupported_architecture_names_the_supported_list():
    with pytest.raises(ModelLoadError) as e:
        parse_config(_raw("GemmaForCausalLM"))
    msg = str(e.value)
    assert "\n" not in msg and "unsupported architecture GemmaForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert arch in msg


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_decode_attention_window_reads_the_last_positions_only(backend):
    """A window of 5 over lanes of lengths 0, 3, 9 and 40: each lane attends to its last
    min(len, 5) positions (a float64 softmax over exactly those), NaN everywhere else."""
    from fgchat.engine.kernels.attention import get_backend

    g = torch.Generator().manual_seed(0)
    s, t, hq, hkv, d, window = 4, 48, 4, 2, 16, 5
    k = torch.randn(s, t, hkv, d, generator=g)
    v = torch.randn(s, t, hkv, d, generator=g)
    lens = [0, 3, 9, 40]
    slots = [2, 0, 3, 1]
    for lane, (sl, n) in enumerate(zip(slots, lens)):  # outside the window: NaN
        k[sl, : max(0, n - window)] = float("nan")
        k[sl, n:] = float("nan")
        v[sl, : max(0, n - window)] = float("nan")
        v[sl, n:] = float("nan")
    q = torch.randn(len(lens), hq, d, generator=g)
    out = torch.empty_like(q)
    att = get_backend(backend, torch.device("cpu"))
    att(q, k, v, torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), out, d ** -0.5,
        None, window=window)
    for lane, (sl, n) in enumerate(zip(slots, lens)):
        lo = max(0, n - window)
        if n == 0:
            assert torch.equal(out[lane], torch.zeros_like(out[lane]))
            continue
        kk = k[sl, lo:n].double().repeat_interleave(hq // hkv, dim=1)
        vv = v[sl, lo:n].double().repeat_interleave(hq // hkv, dim=1)
        p = (torch.einsum("hd,thd->ht", q[lane].double(), kk) * d ** -0.5).softmax(-1)
        torch.testing.assert_close(out[lane].double(), torch.einsum("ht,thd->hd", p, vv), rtol=1e-5, atol=1e-5)
