"""A prompt that starts with what a free slot still holds is prefilled from there (engine.prefix_reuse,
prefill.prefill_after): checked against transformers in float32, never against another fast path."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kv_cache import KVCache
from fgchat.engine.loader import load_model
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.model.prefill import prefill_after
from fgchat.engine.prefix_reuse import MIN_REUSE, SlotHistory
from fgchat.protocol.events import RequestFinished, SamplingParams
from fgchat.protocol.tuning import Tuning

CPU = torch.device("cpu")


def random_ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    transformers = pytest.importorskip("transformers")
    cache: dict[str, object] = {}

    def get(which: str):
        if which not in cache:
            cache[which] = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_dirs[which], dtype=torch.float32).eval()
        return cache[which]
    return get


@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("split", [20, 36])
def test_a_prompt_prefilled_after_its_cached_rows_gives_transformers_logits(tiny_model_dirs, hf_models,
                                                                             which, split):
    m = load_model(str(tiny_model_dirs[which]), CPU, torch.float32)
    dec = Decoder(m.cfg, m.weights, 128, fused=False)
    cache = KVCache(m.cfg, 128, CPU, torch.float32)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))  # rows no prefill wrote must never matter
    ids = torch.tensor(random_ids(37, 4, m.cfg.vocab_size))
    dec.prefill(ids[:split], 5, cache.k, cache.v)
    logits = prefill_after(dec, ids[split:], split, 5, cache.k, cache.v)
    with torch.no_grad():
        hf = hf_models(which)(ids[None]).logits[0, -1]
    torch.testing.assert_close(logits, hf, rtol=1e-4, atol=1e-4)
    # and the rows it wrote are the ones a whole prefill writes
    whole = KVCache(m.cfg, 128, CPU, torch.float32)
    dec.prefill(ids, 2, whole.k, whole.v)
    torch.testing.assert_close(cache.k[1][5, :37], whole.k[1][2, :37], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[1][5, :37], whole.v[1][2, :37], rtol=1e-5, atol=1e-5)


def test_slot_history_picks_the_longest_reusable_prefix_and_keeps_other_histories():
    h = SlotHistory(4)
    a = list(range(100, 200))
    h.record(1, a[:60])
    h.record(2, a[:80] + [7, 7])
    assert h.choose(a, [0, 1, 2, 3]) == (2, 80, None), "the next turn of slot 2's chat"
    assert h.choose(a[:80], [0, 1, 2, 3]) == (2, 79, None), "one prompt token is always prefilled"
    assert h.choose(a, [0, 1, 3]) == (1, 60, None)
    assert h.reusable(1, a[: MIN_REUSE - 1] + [5] * 40) == 0, "too short a prefix is prefilled again"
    assert h.choose([5] * 50, [1, 2, 3]) == (3, 0, None), "no match: a slot without a history"
    assert h.choose([5] * 50, [1, 2]) == (1, 0, None)
    h.forget(2)
    assert h.choose(a, [2]) == (2, 0, None)


def test_a_chat_that_shares_only_the_start_of_a_slot_copies_those_rows_and_leaves_the_history():
    h = SlotHistory(3)
    system = list(range(1000, 1040))  # a long system prompt both chats start with
    h.record(0, system + list(range(300)))  # chat 1, several turns
    other = system + [7] * 30
    assert h.choose(other, [0, 1, 2]) == (1, 40, 0), "own slot, rows copied from slot 0"
    assert h.choose(other, [0]) == (0, 40, None), "no slot without a history: taken in place"
    nearly = system + list(range(290)) + [9] * 5  # its next turn, the last reply re-tokenized apart
    assert h.choose(nearly, [0, 1, 2]) == (0, 330, None)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out, ids = [], list(ids)
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def run(eng: Engine, prompts: list[list[int]], n: int, cancel_after: int | None = None) -> list:
    rids = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    done: dict[int, object] = {}
    steps = 0
    while len(done) < len(rids):
        for ev in eng.step():
            if isinstance(ev, RequestFinished):
                done[ev.summary.request_id] = ev.summary
        steps += 1
        if cancel_after is not None and steps == cancel_after:
            for rid in rids:
                eng.cancel(rid)
    return [done[r] for r in rids]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=512))


def test_the_next_turn_of_a_chat_prefills_only_what_follows_and_gives_transformers_tokens(
        engine, tiny_llama, hf_models):
    vocab = engine.cfg.vocab_size
    first, second = random_ids(50, 1, vocab), random_ids(45, 2, vocab)
    a1, b1 = run(engine, [first, second], 12)  # two chats at once, in two slots
    assert a1.cached_tokens == b1.cached_tokens == 0
    # each next turn: the conversation so far (outputs as generated) and a new message
    b_next = second + b1.token_ids + random_ids(20, 3, vocab)
    a_next = first + a1.token_ids + random_ids(9, 4, vocab)
    (b2,) = run(engine, [b_next], 8)
    (a2,) = run(engine, [a_next], 8)
    assert b2.cached_tokens == len(second) + 12 - 1  # the last output was never fed back
    assert a2.cached_tokens == len(first) + 12 - 1
    hf = hf_models("llama")
    assert b2.token_ids == hf_greedy(hf, b_next, 8)
    assert a2.token_ids == hf_greedy(hf, a_next, 8)


def test_a_stopped_reply_is_reused_and_the_switch_turns_it_off(engine, tiny_llama, hf_models):
    vocab = engine.cfg.vocab_size
    base = random_ids(60, 5, vocab)
    (cut,) = run(engine, [base], 30, cancel_after=3)
    assert cut.finish_reason == "cancelled" and 0 < cut.output_tokens < 30
    after_cut = base + cut.token_ids + random_ids(7, 8, vocab)
    (resumed,) = run(engine, [after_cut], 6)
    assert resumed.cached_tokens == len(base) + cut.output_tokens - 1
    assert resumed.token_ids == hf_greedy(hf_models("llama"), after_cut, 6)
    engine.history.clear()
    (again,) = run(engine, [base + random_ids(5, 6, vocab)], 4)
    assert again.cached_tokens == 0
    (third,) = run(engine, [base + random_ids(5, 6, vocab) + again.token_ids[:-1] + [9, 9]], 4)
    assert third.cached_tokens == len(base) + 5 + 4 - 1  # the completed reply's slot is reused
    off = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=512,
                              tuning=Tuning(prefix_reuse=False)))
    (x,) = run(off, [base], 6)
    (y,) = run(off, [base + x.token_ids + [4, 4, 4]], 6)
    assert y.cached_tokens == 0
    (z,) = run(engine, [base + x.token_ids + [4, 4, 4]], 6)
    assert z.token_ids == y.token_ids


def test_in_bf16_the_next_turn_stays_as_close_to_float32_as_a_fresh_prefill(tiny_llama, hf_models):
    """The reused rows were written by the earlier turn's decode steps, not by one prefill: in
    bf16 their rounding differs, so the next turn's first logits are held to the error class of
    a fresh bf16 prefill of the same prompt (both against transformers in float32)."""
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="bfloat16", max_context=512))
    vocab = eng.cfg.vocab_size
    fresh_err, reuse_err = [], []
    for seed in range(4):
        base = random_ids(48, 10 + seed, vocab)
        (turn,) = run(eng, [base], 24)
        nxt = base + turn.token_ids + random_ids(6, 20 + seed, vocab)
        slot = max(range(8), key=lambda s: eng.history.reusable(s, nxt))
        m = eng.history.reusable(slot, nxt)
        assert m == len(base) + 23
        ids = torch.tensor(nxt)
        with torch.inference_mode():
            reused = prefill_after(eng.decoder, ids[m:], m, slot, eng.cache.k, eng.cache.v).float()
            fresh = eng.decoder.prefill(ids, (slot + 1) % 8, eng.cache.k, eng.cache.v).float()
            ref = hf_models("llama")(ids[None]).logits[0, -1]
        fresh_err.append((fresh - ref).abs().max().item())
        reuse_err.append((reused - ref).abs().max().item())
        eng.history.clear()
    assert max(reuse_err) <= 2 * max(fresh_err) + 1e-3, (reuse_err, fresh_err)


def test_the_requests_csv_says_how_many_prompt_tokens_were_reused(engine, tmp_path):
    from fgchat.metrics import LatencyLog
    from fgchat.metrics.csv_export import read_requests_csv, write_requests_csv

    base = random_ids(70, 30, engine.cfg.vocab_size)
    (one,) = run(engine, [base], 5)
    (two,) = run(engine, [base + one.token_ids + [7] * 4], 5)
    log = LatencyLog()
    for summary in (one, two):
        log.add_request(summary, "chat-1")
    path = tmp_path / "requests.csv"
    write_requests_csv(path, log.requests_since(0))
    assert [r.cached_tokens for r in read_requests_csv(path)] == [0, 70 + 5 - 1]


def test_a_prefill_that_fails_ends_its_request_with_one_line_and_leaves_no_history(engine, monkeypatch):
    import fgchat.engine.model.prefill as prefill_module

    vocab = engine.cfg.vocab_size
    base = random_ids(64, 40, vocab)
    (one,) = run(engine, [base], 5)
    nxt = base + one.token_ids + [5, 6]

    def broken(*args, **kwargs):
        raise RuntimeError("no memory\nfor the rows")

    monkeypatch.setattr(prefill_module, "prefill_after", broken)
    rid = engine.submit(nxt, SamplingParams(max_tokens=4, ignore_eos=True))
    events = engine.run_until_done()
    (failed,) = [e.summary for e in events if isinstance(e, RequestFinished) and e.summary.request_id == rid]
    errors = [e for e in events if type(e).__name__ == "EngineError" and e.request_id == rid]
    assert failed.finish_reason == "error" and len(errors) == 1 and "\n" not in errors[0].message
    monkeypatch.undo()
    (retry,) = run(engine, [nxt], 4)
    assert retry.cached_tokens == 0, "the failed request's slot holds nothing reusable"


def test_k_replies_to_the_next_turn_share_one_suffix_prefill_and_report_the_same_reuse(engine, hf_models):
    vocab = engine.cfg.vocab_size
    engine.history.clear()
    base = random_ids(56, 50, vocab)
    (one,) = run(engine, [base], 6)
    (other,) = run(engine, [base[:40] + random_ids(20, 52, vocab)], 6)  # another slot shares 40 tokens
    nxt = base + one.token_ids + random_ids(5, 51, vocab)
    again = run(engine, [nxt, nxt], 5)  # K = 2: one prefill, into the slot that holds the most
    assert [s.cached_tokens for s in again] == [len(base) + 6 - 1] * 2
    expected = hf_greedy(hf_models("llama"), nxt, 5)
    assert [s.token_ids for s in again] == [expected, expected]


def test_a_new_chat_with_the_same_start_copies_those_rows_and_the_first_chat_keeps_its_own(engine, hf_models):
    vocab = engine.cfg.vocab_size
    engine.history.clear()
    system = random_ids(40, 60, vocab)  # a long system prompt both chats start with
    chat1 = system + random_ids(30, 61, vocab)
    (a1,) = run(engine, [chat1], 8)
    chat2 = system + random_ids(25, 62, vocab)
    (b1,) = run(engine, [chat2], 6)
    assert b1.cached_tokens == 40, "the shared start, copied into chat 2's own slot"
    assert b1.token_ids == hf_greedy(hf_models("llama"), chat2, 6)
    a_next = chat1 + a1.token_ids + random_ids(4, 63, vocab)
    (a2,) = run(engine, [a_next], 6)
    assert a2.cached_tokens == len(chat1) + 8 - 1, "chat 1's slot kept its whole history"
    assert a2.token_ids == hf_greedy(hf_models("llama"), a_next, 6)
