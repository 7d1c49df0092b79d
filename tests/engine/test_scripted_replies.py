"""What only real model semantics expose, on the scripted model (tests/scripted_model.py), whose
greedy replies are known: EOS from each place a model declares it, sampling filters and penalties
that must change the tokens, and the chat prompt the engine's serving loop assembles (system
prompt, roles, generation prompt). Nothing here runs with ignore_eos unless it says so."""

from __future__ import annotations

import time

import pytest

import scripted_model as sm
from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.process import EngineThread
from fgchat.protocol.events import EngineError, EngineInfo, RequestFinished, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def scripted_dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("scripted")
    return {place: sm.build_scripted_model(root / place, eos_in=place) for place in sm.EOS_PLACES}


@pytest.fixture(scope="module")
def engine(scripted_dirs) -> Engine:
    return Engine(EngineConfig(model=str(scripted_dirs["generation_config"]), device="cpu", max_context=256))


def run(eng: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Submit together (one admission round, so they decode as one batch); summaries in order."""
    rids = [eng.submit(ids, p) for ids, p in requests]
    done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    return [done[r] for r in rids]


def words(ids: list[int]) -> list[str]:
    return [sm.VOCAB[i] for i in ids]


def chat_ids(eng: Engine, messages: list[dict[str, str]]) -> list[int]:
    return eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


HI = [{"role": "user", "content": "hi"}]


# ---- EOS: the stop ids come from config.json, generation_config.json or the tokenizer -----------


@pytest.mark.parametrize("place", sm.EOS_PLACES)
def test_a_reply_stops_at_the_eos_the_model_declares(scripted_dirs, place):
    """<|im_end|> is declared in one place only (a generation_config.json eos_token_id list, an
    int in config.json, the tokenizer's eos_token): the reply ends there, finish "stop"."""
    eng = Engine(EngineConfig(model=str(scripted_dirs[place]), device="cpu", max_context=256))
    assert sm.IM_END in eng.stop_ids
    (s,) = run(eng, [(chat_ids(eng, HI), SamplingParams(max_tokens=12))])
    assert words(s.token_ids) == sm.REPLY and s.finish_reason == "stop"
    assert s.text == "hello world"


def test_eos_as_the_first_token_stops_at_once_and_ignore_eos_runs_on(engine):
    mute = [sm.ID["mute"]]
    (s,) = run(engine, [(mute, SamplingParams(max_tokens=12))])
    assert words(s.token_ids) == ["<|im_end|>"] and s.finish_reason == "stop" and s.text == ""
    (s,) = run(engine, [(chat_ids(engine, HI), SamplingParams(max_tokens=6, ignore_eos=True))])
    assert words(s.token_ids) == sm.REPLY + ["wrong"] * 3 and s.finish_reason == "length"


# ---- sampling filters: at T 100 every token is about as likely; a filter makes it the chain ---------

HOT = 100.0  # the largest temperature fgchat takes: logits of 10 become 0.1, next to 0
COUNT = [sm.ID["count"]]


def test_the_hot_temperature_alone_leaves_the_chain(engine):
    """The premise of the filter tests: unfiltered, T 100 does not follow the chain."""
    outs = run(engine, [(COUNT, SamplingParams(temperature=HOT, seed=s, max_tokens=9)) for s in range(3)])
    assert all(words(o.token_ids)[:3] != sm.COUNT[:3] for o in outs), [words(o.token_ids) for o in outs]


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=0.001), dict(top_k=2, top_p=0.001)],
                         ids=["top_k", "top_p", "both"])
def test_a_filter_keeps_only_the_top_token_in_prefill_and_decode(engine, filters):
    """top-k 1 / a tiny top-p keep the top token only: the first token (picked after the
    prefill) and every decoded one follow the chain, alone and next to lanes that do not filter."""
    p = SamplingParams(temperature=HOT, seed=7, max_tokens=12, **filters)
    (alone,) = run(engine, [(COUNT, p)])
    assert words(alone.token_ids) == sm.COUNT and alone.finish_reason == "stop"
    greedy, unfiltered, filtered = run(engine, [
        (COUNT, SamplingParams(max_tokens=12)),
        (COUNT, SamplingParams(temperature=HOT, seed=8, max_tokens=9)),
        (COUNT, p),
    ])
    assert words(greedy.token_ids) == sm.COUNT and words(filtered.token_ids) == sm.COUNT
    assert words(unfiltered.token_ids)[:3] != sm.COUNT[:3]


ECHO = [sm.ID["echo"]]


@pytest.mark.parametrize("penalty, expected", [
    (dict(repetition_penalty=1.5), ["done", "<|im_end|>"]),  # "echo" is in the prompt: 10 / 1.5 < 9
    (dict(presence_penalty=2.0), ["echo", "done", "<|im_end|>"]),  # once generated: 10 - 2 < 9
    (dict(frequency_penalty=1.5), ["echo", "done", "<|im_end|>"]),  # once generated: 10 - 1.5 < 9
], ids=["repetition", "presence", "frequency"])
def test_a_penalty_breaks_the_repetition_greedy_and_filtered(engine, penalty, expected):
    """"echo" follows itself (10) before "done" (9): each penalty must make "done" win, for a
    greedy request and a filtered sampled one, while an unpenalized lane beside them repeats."""
    plain, greedy, sampled = run(engine, [
        (ECHO, SamplingParams(max_tokens=6)),
        (ECHO, SamplingParams(max_tokens=6, **penalty)),
        (ECHO, SamplingParams(temperature=HOT, top_k=1, seed=3, max_tokens=6, **penalty)),
    ])
    assert words(plain.token_ids) == ["echo"] * 6 and plain.finish_reason == "length"
    assert words(greedy.token_ids) == expected and greedy.finish_reason == "stop"
    assert words(sampled.token_ids) == expected and sampled.finish_reason == "stop"


# ---- the chat prompt the serving loop assembles (the engine process's own code) -------------------


def serve_chats(model, submits: list[tuple[object, list[tuple[int, SamplingParams]], bool]]) -> dict[int, object]:
    """Run the serving loop (EngineThread: the engine process's loop on a thread) and send each
    (messages, requests, fit_context) as one SubmitChats; RequestFinished summaries or EngineErrors
    by request id."""
    h = EngineThread(EngineConfig(model=str(model), device="cpu", max_context=256))
    h.start()
    try:
        out: dict[int, object] = {}
        deadline = time.monotonic() + 60
        while not any(isinstance(e, EngineInfo) for e in h.get_events(0.5)):
            assert time.monotonic() < deadline, "no EngineInfo"
        want = set()
        for messages, requests, fit in submits:
            h.fit_context = fit
            h.submit_chats(messages, requests)
            want |= {r for r, _ in requests}
        while not want <= set(out):
            assert time.monotonic() < deadline, f"no end for {want - set(out)}"
            for e in h.get_events(0.2):
                if isinstance(e, RequestFinished):
                    out[e.summary.request_id] = e.summary
                elif isinstance(e, EngineError) and e.request_id is not None:
                    out[e.request_id] = e
        return out
    finally:
        h.shutdown()


PIRATE = [{"role": "system", "content": "you are a pirate."}, {"role": "user", "content": "hi!"}]
TURNS = [{"role": "system", "content": "you are a pirate."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "arr matey"}, {"role": "user", "content": "tell me more"}]
WRONG_ORDER = [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi"}]


def test_the_serving_loop_renders_system_roles_and_the_generation_prompt(scripted_dirs):
    """The prompt is the model's template with the generation prompt: a system prompt that says
    "pirate" makes the reply "arr matey", none "hello world"; the prompt is exactly the ChatML text
    (written out here, tokenized without fgchat). Both for the server's submits and the TUI's
    (fit_context), K = 1 and K = 2; roles out of order are refused by the template, per request."""
    greedy = SamplingParams(max_tokens=8)
    out = serve_chats(scripted_dirs["generation_config"], [
        (HI, [(1, greedy)], False),
        (PIRATE, [(2, greedy), (3, SamplingParams(max_tokens=8, temperature=HOT, top_k=1))], False),
        (TURNS, [(4, greedy)], True),
        (PIRATE, [(5, greedy)], True),
        (WRONG_ORDER, [(6, greedy)], False),
        ("count", [(7, SamplingParams(max_tokens=12))], False),  # a raw prompt: no template
    ])
    assert words(out[1].token_ids) == sm.REPLY and out[1].text == "hello world"
    for rid in (2, 3, 4, 5):
        assert words(out[rid].token_ids) == sm.PIRATE_REPLY and out[rid].finish_reason == "stop", rid
    for rid, messages in ((1, HI), (2, PIRATE), (4, TURNS)):
        assert out[rid].prompt_tokens == len(sm.encode(sm.chatml(messages))), rid
    assert isinstance(out[6], EngineError) and "roles must alternate" in out[6].message
    assert words(out[7].token_ids) == sm.COUNT and out[7].prompt_tokens == 1
