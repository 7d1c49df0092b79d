"""One admission round: identical prompts share one prefill (engine.admission), and distinct
prompts run through one fused prefill pass (prefill_many_fused, Triton kernels under the
interpreter on CPU). References: transformers in float32 and the unfused float32 prefill."""

from __future__ import annotations

import textwrap

import pytest
import torch

from fgchat.engine.admission import share_prompts
from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kv_cache import KVCache
from fgchat.engine.model.config import parse_config
from fgchat.engine.requests import Sequence
from fgchat.protocol.events import RequestFinished, SamplingParams, TokenEvent
from small_decoders import run_interpreted

K = 4


def make_engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", max_context=256))


def prompt_of(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def summaries(events) -> dict[int, object]:
    return {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}


def seq(rid: int, ids: list[int]) -> Sequence:
    return Sequence(rid, ids, SamplingParams(), frozenset(), 0)


def test_share_prompts_groups_identical_prompts_in_admission_order():
    a, b = [5, 6, 7], [5, 6]
    seqs = [seq(1, a), seq(2, b), seq(3, list(a)), seq(4, [9]), seq(5, list(b)), seq(6, list(a))]
    groups = share_prompts(seqs)
    assert [[s.request_id for s in g] for g in groups] == [[1, 3, 6], [2, 5], [4]]
    assert share_prompts([]) == []


def test_copy_prefix_copies_rows_below_length_into_each_slot_only():
    cfg = parse_config(dict(architectures=["LlamaForCausalLM"], vocab_size=50, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64))
    cache = KVCache(cfg, 16, torch.device("cpu"), torch.float32)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
        t[2] = torch.randn(t.shape[1:])
    cache.copy_prefix(2, [0, 5], 7)
    for t in cache.k + cache.v:
        for d in (0, 5):
            assert torch.equal(t[d, :7], t[2, :7])
            assert torch.isnan(t[d, 7:]).all()
        assert torch.isnan(t[[1, 3, 4, 6, 7]]).all()
    cache.copy_prefix(2, [], 7)  # nothing to copy is fine


def spy_prefills(monkeypatch, eng: Engine) -> list[int]:
    """Prompts per prefill call: one-prompt prefills and one-pass rounds."""
    from fgchat.engine.model import prefill as pf

    calls: list[int] = []
    real_many, real_one = pf.prefill_many, eng.modes.prefill_logits

    def many(dec, prompts, k, v):
        calls.append(len(prompts))
        return real_many(dec, prompts, k, v)

    def one(mode, ids, slot, greedy=False):
        calls.append(1)
        return real_one(mode, ids, slot, greedy)

    monkeypatch.setattr(pf, "prefill_many", many)
    monkeypatch.setattr(eng.modes, "prefill_logits", one)
    return calls


def test_k_identical_prompts_prefill_once_and_match_transformers(tiny_llama, monkeypatch):
    """K greedy replies to one prompt: one prefill, K first tokens in one round, the follower
    slots' K/V bit-equal to the leader's, and every reply equal to transformers' fp32 greedy."""
    transformers = pytest.importorskip("transformers")
    eng = make_engine(tiny_llama)
    calls = spy_prefills(monkeypatch, eng)
    prompt = prompt_of(19, 3, eng.cfg.vocab_size)
    rids = [eng.submit(prompt, SamplingParams(max_tokens=12, ignore_eos=True)) for _ in range(K)]
    first_round = eng.step() + eng.step()  # the prefill's first tokens, then the first decode step
    assert calls == [1]
    tokens = [e for e in first_round if isinstance(e, TokenEvent)]
    assert sorted(e.request_id for e in tokens if e.is_first_token) == sorted(rids)
    assert {e.batch_size for e in tokens if not e.is_first_token} == {K}
    slots = [s.slot for s in eng.scheduler.running]
    assert len(set(slots)) == K
    for t in eng.cache.k + eng.cache.v:
        for s in slots[1:]:
            assert torch.equal(t[s, :len(prompt)], t[slots[0], :len(prompt)])
    done = summaries(first_round + eng.run_until_done())
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert [done[r].token_ids for r in rids] == [want] * K


def test_shared_prefill_samples_each_reply_with_its_own_seed(tiny_llama, monkeypatch):
    """Sampled replies sharing a prefill equal the same requests run alone (seeded sampling),
    and differ from each other."""
    eng = make_engine(tiny_llama)
    prompt = prompt_of(9, 8, eng.cfg.vocab_size)
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=s) for s in range(K)]
    alone = []
    for p in params:
        rid = eng.submit(prompt, p)
        alone.append(summaries(eng.run_until_done())[rid].token_ids)
    calls = spy_prefills(monkeypatch, eng)
    other = prompt_of(6, 9, eng.cfg.vocab_size)
    rids = [eng.submit(prompt, p) for p in params]
    lone = eng.submit(other, SamplingParams(max_tokens=10, ignore_eos=True))
    done = summaries(eng.run_until_done())
    assert calls == [2]  # two distinct prompts, one pass
    assert [done[r].token_ids for r in rids] == alone
    assert len({tuple(t) for t in alone}) == K
    assert len(done[lone].token_ids) == 10


FUSED_MANY_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys, torch
    sys.path.insert(0, "tests")
    from small_decoders import scaled_weights, small_config
    from fgchat.engine.model.decoder import Decoder, DecoderWeights, LayerWeights
    from fgchat.engine.kv_cache import KVCache

    def cast(w, dt):
        conv = lambda t: None if t is None else t.to(dt)
        layers = [LayerWeights(**{f.name: conv(getattr(lw, f.name)) for f in dataclasses.fields(lw)})
                  for lw in w.layers]
        return DecoderWeights(conv(w.embed), layers, conv(w.final_norm), conv(w.lm_head))

    out = []
    lens_slots = [(5, 6), (33, 1), (17, 3)]
    from fgchat.engine.model import prefill as pf
    attention = pf.PaddedPrompts.attention
    padded_calls = []
    pf.PaddedPrompts.attention = lambda self, *a: padded_calls.append(1) or attention(self, *a)
    for heads, kv_heads, bias, dtype, route in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        # padded: one batched SDPA over right-padded prompts; per-prompt: attention prompt by
        # prompt; batch: the whole prefill as one batch of equal padded length (batch_bucket)
        pf.PAD_SHORT_TMAX, pf.PAD_WASTE_LIMIT = (256, 2.0) if route == "padded" else (0, 0.0)
        padded_calls.clear()
        cfg = small_config(heads, kv_heads, bias)
        w = scaled_weights(cfg, torch.float32)
        w = cast(w, dtype)
        w32 = cast(w, torch.float32)  # the reference: the same (rounded) weights in float32
        g = torch.Generator().manual_seed(1)
        prompts = [(torch.randint(0, 300, (t,), generator=g), s) for t, s in lens_slots]
        fused = Decoder(cfg, w, 64, fused=True)
        cache = KVCache(cfg, 64, torch.device("cpu"), dtype)
        for t in cache.k + cache.v:
            t.fill_(float("nan"))
        from fgchat.engine.model.prefill import prefill_many_fused
        tb = pf.batch_bucket([t for t, _ in lens_slots], 64)
        if route == "batch":
            many = pf.prefill_batch(fused, prompts, tb, cache.k, cache.v)
        else:
            many = prefill_many_fused(fused, prompts, cache.k, cache.v)
        ref = Decoder(cfg, w32, 64, fused=False)
        rcache = KVCache(cfg, 64, torch.device("cpu"), torch.float32)
        res = dict(logits=0.0, scale=0.0, kv=0.0, kv_scale=0.0, finite=True, argmax=True,
                   padded_calls=len(padded_calls), layers=cfg.num_layers)
        for (ids, slot), got in zip(prompts, many):
            want = ref.prefill(ids, slot, rcache.k, rcache.v)
            res["logits"] = max(res["logits"], (got - want).abs().max().item())
            res["scale"] = max(res["scale"], want.abs().max().item())
            res["finite"] &= bool(torch.isfinite(got).all()) and got.dtype == torch.float32
            res["argmax"] &= int(got.argmax()) == int(want.argmax())
            t = ids.shape[0]
            for a, b in zip(cache.k + cache.v, rcache.k + rcache.v):
                res["kv"] = max(res["kv"], (a[slot, :t].float() - b[slot, :t]).abs().max().item())
                res["kv_scale"] = max(res["kv_scale"], b[slot, :t].abs().max().item())
        used = torch.tensor([s for _, s in lens_slots])
        free = torch.ones(8, dtype=torch.bool)
        free[used] = False
        res["untouched"] = all(torch.isnan(t[free]).all().item() for t in cache.k + cache.v)
        # the batch route writes its padding rows [T, tb) too (decode overwrites them first)
        res["past_prompt"] = all(torch.isnan(t[s, tb if route == "batch" else n:]).all().item()
                                 for t in cache.k + cache.v for n, s in lens_slots)
        res["tb"] = tb
        out.append(res)
    print("RESULT " + json.dumps(out))
    """
)


def test_fused_prefill_of_several_prompts_matches_fp32_reference_interpreted():
    """prefill_many_fused (Triton kernels under the interpreter) against each prompt prefilled
    alone by the unfused path in float32 from the same weights: last logits and the K/V rows
    of each prompt's slot; no other slot and no row past a prompt is written. Attention both as
    one SDPA over the right-padded prompts and prompt by prompt (prompts of 5, 33 and 17 tokens);
    and the batch route (prefill_batch: every prompt padded to 64 rows, one batch)."""
    pytest.importorskip("triton")
    cases = [(4, 2, False, "float32", "padded"), (4, 2, False, "float32", "per-prompt"),
             (6, 2, True, "float32", "padded"), (4, 2, False, "bfloat16", "padded"),
             (4, 2, False, "float32", "batch"), (6, 2, True, "float32", "batch"),
             (4, 2, False, "bfloat16", "batch")]
    for case, r in zip(cases, run_interpreted(FUSED_MANY_SCRIPT, cases)):
        assert r["tb"] == 64, r
        assert r["padded_calls"] == (r["layers"] if case[4] == "padded" else 0), (case, r)
        assert r["finite"] and r["untouched"] and r["past_prompt"], (case, r)
        if case[3] == "float32":
            assert r["logits"] <= 1e-4 * max(r["scale"], 1.0), (case, r)
            assert r["kv"] <= 1e-5 * max(r["kv_scale"], 1.0), (case, r)
            assert r["argmax"], (case, r)
        else:  # bf16 operands against fp32: relative error of a few 1e-3
            assert r["logits"] <= 0.03 * r["scale"], (case, r)
            assert r["kv"] <= 0.02 * r["kv_scale"], (case, r)


def test_first_tokens_of_a_mixed_round_equal_each_request_alone(tiny_llama):
    """One admission round of greedy, sampled (unfiltered and top-k), penalized requests, two of
    them sharing a prompt: each first token is picked together with the others' (one pick over
    stacked logits) yet equals the request's own when it runs alone; the greedy ones equal the
    argmax of transformers' float32 logits of their prompt."""
    transformers = pytest.importorskip("transformers")
    eng = make_engine(tiny_llama)
    v = eng.cfg.vocab_size
    shared = prompt_of(11, 21, v)
    reqs = [
        (shared, SamplingParams(max_tokens=1, ignore_eos=True)),
        (prompt_of(7, 22, v), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.8, seed=5)),
        (shared, SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.1, top_k=4, seed=6)),
        (prompt_of(13, 23, v), SamplingParams(max_tokens=1, ignore_eos=True, repetition_penalty=1.5)),
        (prompt_of(5, 24, v), SamplingParams(max_tokens=1, ignore_eos=True)),
    ]
    alone = []
    for prompt, params in reqs:
        rid = eng.submit(prompt, params)
        alone.append(summaries(eng.run_until_done())[rid].token_ids)
    rids = [eng.submit(prompt, params) for prompt, params in reqs]
    first_round = eng.step()
    firsts = {e.request_id: e.token_id for e in first_round if isinstance(e, TokenEvent) and e.is_first_token}
    assert [[firsts[r]] for r in rids] == alone
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for (prompt, params), got in zip(reqs, alone):
        if params.temperature == 0 and not params.penalized:
            with torch.no_grad():
                logits = ref(torch.tensor([prompt])).logits[0, -1]
            assert got == [int(logits.argmax())]
