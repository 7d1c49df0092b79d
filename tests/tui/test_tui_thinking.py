"""Thinking replies (issue 54): the setting "thinking" reaches the engine as the chat's
enable_thinking; a reply's <think> block is shown folded to one line with its token count, F8
expands and folds it; the block's tokens stay tokens of the reply in its stats and the latency
CSV. Pilot with a real engine on the scripted model (tests/scripted_model.py: with
enable_thinking true it replies "<think> hmm </think> hello world")."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import scripted_model as sm
from fgchat.engine.commands import SubmitChats
from fgchat.engine.core import EngineConfig
from fgchat.engine.process import EngineThread
from fgchat.metrics import read_tokens_csv
from fgchat.protocol.events import SamplingParams
from fgchat.tui.app import FgchatApp
from fgchat.tui.thinking import THINK_CLOSE, THINK_OPEN, ThinkCounter, split_thinking
from test_tui import SIZE, assistant_bubbles, data_dir, key, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    return sm.build_scripted_model(tmp_path_factory.mktemp("think") / "scripted", eos_in="generation_config")


def scripted_app(model: Path) -> FgchatApp:
    config = EngineConfig(model=str(model), device="cpu", mode="eager", max_context=256)
    return FgchatApp(config, engine_factory=lambda cfg: EngineThread(cfg), sampling=SamplingParams(max_tokens=16))


def spy_commands(app: FgchatApp) -> list[SubmitChats]:
    """Every SubmitChats the app's engine handle sends from now on."""
    sent: list[SubmitChats] = []
    handle = app.link.handle
    send = handle._send

    def spy(cmd) -> None:
        if isinstance(cmd, SubmitChats):
            sent.append(cmd)
        send(cmd)

    handle._send = spy
    return sent


async def reply_to(pilot, app: FgchatApp, text: str):
    conv = app.chats.current.conversation
    n = len(conv.messages)
    await type_prompt(pilot, text)
    await wait_for(pilot, lambda: len(conv.messages) == n + 2 and not app.replies, "the reply")
    await pilot.pause(0.05)
    return conv.messages[-1]


def reference_thinking_tokens(pieces: list[str]) -> int | None:
    """Tokens from the first through the one completing the close tag (all of them while the
    block is open); None without a block. Written from whole prefixes, unlike ThinkCounter."""
    whole = "".join(pieces).lstrip()
    if not whole.startswith(THINK_OPEN):
        return None
    for j in range(1, len(pieces) + 1):
        if THINK_CLOSE in "".join(pieces[:j]).lstrip()[len(THINK_OPEN):]:
            return j
    return len(pieces)


def test_counter_and_split_agree_with_whole_text_references():
    rng = random.Random(0)
    texts = ["\n<think>\nlet me see </ not yet </think>\n\nThe answer.", "<think>short</think>ok",
             "Plain reply, <think> later is text", "<thinking aloud", "  <think> never closed </thi"]
    for text in texts:
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            counter = ThinkCounter()
            shown_thinking, shown_answer = "", ""
            for i, piece in enumerate(pieces):
                counter.feed(piece)
                split = split_thinking("".join(pieces[:i + 1]))
                # what is drawn by appending stays a prefix of what comes later
                assert (split.thinking or "").startswith(shown_thinking) and split.answer.startswith(shown_answer)
                shown_thinking, shown_answer = split.thinking or shown_thinking, split.answer or shown_answer
            expected = reference_thinking_tokens(pieces)
            assert (counter.tokens if counter.found else None) == expected, pieces
        final = split_thinking(text, final=True)
        head = text.lstrip()
        if head.startswith(THINK_OPEN) and THINK_CLOSE in head:
            inner, _, answer = head[len(THINK_OPEN):].partition(THINK_CLOSE)
            assert (final.thinking, final.answer) == (inner.lstrip(), answer.lstrip())
        elif head.startswith(THINK_OPEN):
            assert (final.thinking, final.answer) == (head[len(THINK_OPEN):].lstrip(), "")
        else:
            assert (final.thinking, final.answer) == (None, text)


async def test_a_think_block_is_folded_expands_on_f8_and_its_tokens_are_logged(scripted, data_dir, tmp_path):
    data_dir.mkdir(parents=True)
    (data_dir / "settings.json").write_text(json.dumps({"thinking": True}))
    app = scripted_app(scripted)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        sent = spy_commands(app)
        reply = await reply_to(pilot, app, "hi")
        assert [cmd.enable_thinking for cmd in sent] == [True]
        assert "thinking on" in app.sub_title
        # the whole reply is stored; every token counts, the think block's included
        assert reply.content == "<think> hmm </think> hello world"
        assert (reply.meta["tokens"], reply.meta["thinking_tokens"]) == (len(sm.THINK_REPLY), 3)
        (bubble,) = assistant_bubbles(app)
        assert f"{len(sm.THINK_REPLY)} tok" in bubble.status
        summary = bubble.query_one(".thinking-summary").render()
        assert str(summary) == "▸ thinking · 3 tokens · F8 expands"
        assert [md.source for md in bubble.query("Markdown")] == ["hello world"]  # folded: the answer only

        await key(pilot, "f8")
        await wait_for(pilot, lambda: bubble.expanded, "expanded")
        await pilot.pause(0.05)
        think_md = bubble.query_one("Markdown.thinking-body")
        assert think_md.display and think_md.source.strip() == "hmm"
        assert "F8 folds" in str(bubble.query_one(".thinking-summary").render())
        await key(pilot, "f8")
        await wait_for(pilot, lambda: not bubble.expanded, "folded again")
        assert not think_md.display

        # the stored reply, shown again (a reopened chat): folded, with the stored count
        again = await app.chats.current.add_message(reply)
        await pilot.pause(0.05)
        assert str(again.query_one(".thinking-summary").render()) == "▸ thinking · 3 tokens · F8 expands"
        assert [md.source for md in again.query("Markdown")] == ["hello world"]

        # the latency log and its CSV hold a row for each token of the reply, thinking included
        rid = reply.meta["rid"]
        rows = [t for t in app.latency.log.tokens() if t.request_id == rid]
        assert [t.token_index for t in rows] == list(range(len(sm.THINK_REPLY)))
        app.log_files.export(tmp_path / "out-tokens.csv")
        exported = [t for t in read_tokens_csv(tmp_path / "out-tokens.csv") if t.request_id == rid]
        assert len(exported) == len(sm.THINK_REPLY)


async def test_the_setting_reaches_the_engine_and_a_plain_reply_is_unchanged(scripted, data_dir):
    data_dir.mkdir(parents=True)
    (data_dir / "settings.json").write_text(json.dumps({"thinking": "yes"}))
    app = scripted_app(scripted)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        shown = [text for sev, text in app.notices if sev == "warning"]
        assert len(shown) == 1 and '"thinking"' in shown[0] and "ignored" in shown[0], shown
        sent = spy_commands(app)
        plain = await reply_to(pilot, app, "hi")  # the wrong-typed value: the template's default
        assert plain.content == "hello world" and "thinking_tokens" not in plain.meta
        (bubble,) = assistant_bubbles(app)
        assert not bubble.query(".thinking-summary") and [md.source for md in bubble.query("Markdown")] == ["hello world"]
        app.set_thinking(False)
        await reply_to(pilot, app, "hi")
        app.set_thinking(True)
        thought = await reply_to(pilot, app, "hi")
        assert [cmd.enable_thinking for cmd in sent] == [None, False, True]
        assert thought.content.startswith("<think>")
        # F8 acts on the last reply that has thinking
        await key(pilot, "f8")
        await wait_for(pilot, lambda: assistant_bubbles(app)[-1].expanded, "the last reply expanded")
    assert json.loads((data_dir / "settings.json").read_text())["thinking"] is True
