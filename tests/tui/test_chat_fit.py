"""A chat longer than the context: its oldest turns leave the prompt (engine.chat_fit), in the
engine process's command handling and in the real TUI with a real engine on the tiny model."""

from __future__ import annotations

import pytest

from fgchat.engine.chat_fit import fit_chat
from fgchat.engine.commands import SubmitChats
from fgchat.engine.serve_loop import _apply_chats
from fgchat.protocol.events import EngineError, RequestNotice, SamplingParams
from test_tui import data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401


def words(messages) -> list[int]:
    """A stand-in tokenizer: one id per word, two per message for its framing."""
    return [0] * sum(len(m["content"].split()) + 2 for m in messages)


def chat(turns: int, size: int = 10) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs += [{"role": "user", "content": f"q{i} " * size}, {"role": "assistant", "content": f"a{i} " * size}]
    return msgs + [{"role": "user", "content": "last question"}]


def test_the_oldest_turns_go_first_in_pairs_and_the_system_and_last_messages_stay():
    msgs = chat(5)  # 4 (system) + 5 x 24 + 4 (last) = 128 ids
    ids, dropped = fit_chat(words, msgs, max_context=200, reserve=50)
    assert (len(ids), dropped) == (128, 0)
    ids, dropped = fit_chat(words, msgs, max_context=120, reserve=20)  # room for 100
    assert dropped == 2 * 2 and len(ids) == 128 - 2 * 24 <= 100
    ids, dropped = fit_chat(words, msgs, max_context=30, reserve=20)  # not even the last turn fits
    assert dropped == 10 and len(ids) == 8  # system + last message: the shortest there is
    lone = [{"role": "user", "content": "x " * 50}]
    assert fit_chat(words, lone, max_context=20, reserve=5) == ([0] * 52, 0)


def test_what_is_left_out_stays_the_same_while_the_chat_grows_within_a_quantum():
    """Consecutive turns keep one prefix (so the engine can reuse its rows) until the overflow
    passes the next quantum of tokens."""
    left_out = []
    for turns in range(5, 12):
        msgs = chat(turns)
        ids, dropped = fit_chat(words, msgs, max_context=160, reserve=20, quantum=40)
        assert len(ids) <= 140 and dropped % 2 == 0
        kept = msgs[:1] + msgs[1 + dropped:]
        assert words(kept) == ids
        left_out.append(dropped)
    # 128, 152, ... 272 ids: over by -12, 12, 36, 60, 84, 108, 132 -> 0, 40, 40, 80, 120, 120, 160 tokens
    assert left_out == [0, 4, 4, 8, 10, 10, 14]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from fgchat.engine.core import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", max_context=256))


def long_chat(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are brief."}]
    for i in range(turns):
        msgs += [{"role": "user", "content": " ".join(f"question{i} word{j}" for j in range(12))},
                 {"role": "assistant", "content": " ".join(f"answer{i} part{j}" for j in range(12))}]
    return msgs + [{"role": "user", "content": "and now?"}]


def test_the_engine_process_fits_a_long_chat_only_when_asked(engine):
    msgs = long_chat(8)
    assert len(engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)) > 256
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    refused = _apply_chats(engine, SubmitChats(msgs, ((101, params),)))
    assert len(refused) == 1 and isinstance(refused[0], EngineError) and "context holds 256" in refused[0].message
    fitted = _apply_chats(engine, SubmitChats(msgs, ((102, params), (103, params)), fit_context=True))
    (notice,) = fitted
    assert isinstance(notice, RequestNotice) and notice.request_id == 102
    assert "oldest" in notice.message and "\n" not in notice.message
    seqs = [s for s in engine.scheduler.waiting if s.request_id in (102, 103)]
    assert len(seqs) == 2 and len(seqs[0].prompt_ids) <= 256 - 16
    kept = int(notice.message.split("oldest ")[1].split(" ")[0])
    assert kept % 2 == 0 and kept >= 2  # whole turns
    engine.run_until_done()


async def test_the_tui_keeps_chatting_past_the_context_and_says_so(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=4, max_context=256)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        for i in range(14):
            await type_prompt(pilot, " ".join(f"message{i} word{j}" for j in range(5)))
            await wait_for(pilot, lambda: app.latency.log.request_count == i + 1 and not app.replies,
                           f"reply {i + 1}", 60)
        requests = app.latency.log.requests()
        assert "error" not in [r.finish_reason for r in requests], app.notices
        full = [text for _, text in app.notices if text.startswith("context full")]
        assert full and len(full) == len(set(full)), "each notice once per chat"
        assert all(r.prompt_tokens <= 256 - 4 for r in requests)
        # while what is left out stays the same, a turn reuses the rows of the one before
        assert any(r.cached_tokens >= 100 for r in requests[2:]), [(r.prompt_tokens, r.cached_tokens) for r in requests]
