"""Speculative decoding on CPU (engine.speculate): greedy output token for token the plain
engine's, for every proposer and in ragged batches; rejected drafts' cache rows never reach a
later token; seeded sampling reproducible; a draft of another vocabulary refused in one line.
The reference is always a plain run of the same engine configuration without speculation."""

from __future__ import annotations

import itertools

import pytest
import torch

from fgchat.engine.core import Engine
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.errors import FgchatError, ModelLoadError
from fgchat.protocol.events import RequestFinished, SamplingParams, TokenEvent

REPEATING = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


def engine(**kw) -> Engine:
    """A CPU engine whose step clock ticks 1 ms per read: every step costs the same, so whether
    speculation pays (speculate.payoff, tested with its own clocks in test_speculate_payoff.py)
    never turns on a loaded machine's timing noise here."""
    kw.setdefault("preset", "tiny")
    eng = Engine(EngineConfig(device="cpu", seed=3, **kw))
    ticks = itertools.count()
    eng.clock = lambda: next(ticks) * 1e-3
    return eng


def run(eng: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """Every prompt submitted together (one batch); (summaries in prompt order, token events)."""
    ps = params if isinstance(params, list) else [params] * len(prompts)
    rids = [eng.submit(p, sp) for p, sp in zip(prompts, ps)]
    evs = eng.run_until_done()
    done = {e.summary.request_id: e.summary for e in evs if isinstance(e, RequestFinished)}
    return [done[r] for r in rids], [e for e in evs if isinstance(e, TokenEvent)]


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return engine()


def test_ngram_greedy_is_plain_decoding_and_accepts_drafts(plain):
    want, _ = run(plain, [REPEATING], GREEDY)
    got, evs = run(engine(speculate="ngram"), [REPEATING], GREEDY)
    assert got[0].token_ids == want[0].token_ids
    spec = got[0].spec
    assert spec["method"] == "ngram" and spec["accepted"] > 0 and spec["tokens_per_step"] > 1.0
    drafted = [e for e in evs if e.drafted]
    assert len(drafted) == spec["accepted"]
    assert all(e.spec_method == "ngram" and e.accepted_in_step >= 1 for e in drafted)
    # a step's tokens share its step id; step ids count the request's decode steps from 0
    steps = sorted({e.step_id for e in evs})
    assert steps[0] == -1 and steps[1:] == list(range(len(steps) - 1))
    print(f"ngram: {spec}")


def test_oracle_drafts_a_second_run_of_the_same_prompt(plain):
    prompt = random_prompt(12, 1)
    want, _ = run(plain, [prompt], GREEDY)
    eng = engine(speculate="oracle", draft_len=4)
    first, _ = run(eng, [prompt], GREEDY)  # nothing recorded yet: plain steps, then recorded
    again, evs = run(eng, [prompt], GREEDY)
    assert first[0].token_ids == want[0].token_ids == again[0].token_ids
    assert again[0].spec["acceptance_rate"] == 1.0
    assert again[0].spec["tokens_per_step"] > 4.0  # 5 tokens a step at k = 4, the last step shorter
    assert max(e.draft_len for e in evs) == 4


@pytest.mark.parametrize("draft", ["self", "other"])
def test_a_draft_model_leaves_greedy_output_unchanged(tiny_llama, draft):
    """A model drafting for itself (every draft accepted) and a different model of the same
    tokenizer (random weights of the preset's shape, another seed: drafts mostly rejected)."""
    if draft == "self":
        kw = dict(preset=None, model=str(tiny_llama))
        draft_name = str(tiny_llama)
    else:
        kw, draft_name = {}, "preset:tiny"
    prompts = [random_prompt(9, 2, 300), REPEATING]
    want, _ = run(engine(**kw), prompts, GREEDY)
    got, _ = run(engine(speculate="draft", draft=draft_name, **kw), prompts, GREEDY)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    rates = [s.spec["acceptance_rate"] for s in got]
    if draft == "self":
        assert all(r == 1.0 for r in rates)
    else:
        assert any(s.spec["proposed"] > s.spec["accepted"] for s in got)  # some drafts rejected
    print(f"draft {draft}: acceptance {rates}")


def test_a_batch_with_ragged_acceptance_matches_plain_decoding_lane_by_lane(plain):
    prompts = [REPEATING, random_prompt(7, 5), REPEATING[3:] + REPEATING[:3], random_prompt(20, 6)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 17, 25, 9)]
    want, _ = run(plain, prompts, params)
    got, evs = run(engine(speculate="ngram", draft_len=3), prompts, params)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.output_tokens for s in got] == [30, 17, 25, 9]
    # lanes accepted differently within the same steps
    assert len({s.spec["accepted"] for s in got}) > 1
    assert max(e.batch_size for e in evs) == 4


def test_rejected_drafts_rows_never_reach_later_tokens_at_the_cache_end(plain):
    """Every draft rejected (the oracle recorded a wrong continuation), up to the cache's last
    row: the rows verification wrote for the drafts are past each length and rewritten before
    use; the cache is poisoned with NaN first, so a row read before it is written shows."""
    prompt = random_prompt(30, 7)
    small = dict(max_context=64)
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    want, _ = run(engine(**small), [prompt], long)
    eng = engine(speculate="oracle", draft_len=8, **small)
    eng.cache.all.fill_(float("nan"))
    wrong = [(t + 1) % 512 for t in want[0].token_ids]
    eng.spec_oracle.record(prompt, want[0].token_ids[:1] + wrong[1:])  # every draft wrong
    got, evs = run(eng, [prompt], long)
    assert got[0].token_ids == want[0].token_ids
    assert got[0].finish_reason == "length" and got[0].prompt_tokens + got[0].output_tokens == 64
    assert got[0].spec["proposed"] > 0 and got[0].spec["accepted"] == 0
    # the oracle verifies every step (no adaptive pause), up to the cache's last row (the last
    # step has no room for a draft)
    steps = [e.draft_len for e in evs if not e.is_first_token]
    assert all(steps[:-1]) and steps[-2] == 1


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=30, ignore_eos=True)
    runs = [run(engine(speculate="draft", draft="preset:tiny"), [REPEATING], params)[0][0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = run(engine(speculate="draft", draft="preset:tiny"), [REPEATING],
                SamplingParams(temperature=0.8, top_k=20, seed=12, max_tokens=30, ignore_eos=True))[0][0]
    assert other.token_ids != runs[0]


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(tiny_llama):
    with pytest.raises(ModelLoadError) as err:
        engine(speculate="draft", draft=str(tiny_llama))  # 384 tokens against the preset's 512
    assert "\n" not in str(err.value) and "vocabulary" in str(err.value)


def test_speculation_switches_live_and_checks_its_arguments():
    eng = engine()
    assert eng.info().speculate == "off" and eng.info().draft_len == 0
    eng.set_speculation("ngram", 6)
    assert (eng.info().speculate, eng.info().draft_len) == ("ngram", 6)
    got, _ = run(eng, [REPEATING], GREEDY)
    assert got[0].spec["draft_len"] == 6
    for bad in (lambda: eng.set_speculation("medusa"), lambda: eng.set_speculation("ngram", 9),
                lambda: eng.set_speculation("draft")):  # draft without a draft model
        with pytest.raises(FgchatError):
            bad()
    eng.set_speculation("off")
    got, evs = run(eng, [REPEATING], GREEDY)
    assert got[0].spec is None and all(e.spec_method == "" and not e.drafted for e in evs)


def test_set_speculation_through_a_handle_answers_with_engine_info():
    import time

    from fgchat.engine.process import EngineThread
    from fgchat.protocol.events import EngineError, EngineInfo

    h = EngineThread(EngineConfig(preset="tiny", device="cpu"))
    h.start()
    try:
        def next_info(deadline: float = 30.0):
            end = time.monotonic() + deadline
            while time.monotonic() < end:
                for ev in h.get_events(0.1):
                    if isinstance(ev, (EngineInfo, EngineError)):
                        return ev
            raise AssertionError("no EngineInfo")

        assert next_info().speculate == "off"
        h.set_speculation("ngram", 5)
        info = next_info()
        assert (info.speculate, info.draft_len, info.draft_model) == ("ngram", 5, "")
        h.set_speculation("draft")  # no draft model configured: one line, the engine goes on
        err = next_info()
        assert isinstance(err, EngineError) and not err.fatal and "needs --draft" in err.message
    finally:
        h.shutdown()


def test_oracle_drafts_given_with_the_request_are_used():
    """SamplingParams.oracle_tokens: the drafts come from the request itself (no earlier run),
    every one accepted when they are the target's own greedy continuation."""
    from fgchat.engine.core import Engine
    from fgchat.engine.loader import load_random
    from fgchat.protocol.config import EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams

    def run(method: str, oracle: list[int] | None = None) -> list[int]:
        cfg = EngineConfig(preset="tiny", device="cpu", dtype="float32", seed=1, max_context=96, speculate=method)
        eng = Engine(cfg, load_random("tiny", torch.device("cpu"), torch.float32, seed=1))
        rid = eng.submit([3, 7, 11, 5], SamplingParams(max_tokens=12, ignore_eos=True, oracle_tokens=oracle))
        done = [e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished) and e.summary.request_id == rid]
        return done[0]

    plain = run("off")
    spec = run("oracle", plain.token_ids)
    assert spec.token_ids == plain.token_ids
    assert spec.spec is not None and spec.spec["accepted"] > 0 and spec.spec["accepted"] == spec.spec["proposed"]
