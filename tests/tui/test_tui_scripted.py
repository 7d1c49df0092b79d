"""The TUI through Pilot with real engines: on the scripted model (tests/scripted_model.py, replies
known in advance, run without ignore_eos) the chat's system prompt and turns reach the engine
process's prompt and a reply ends at the model's EOS; on the tiny random model, a SIGTERM during
K = 2 replies has both stored as interrupted by the time the signal handler returns, before the
UI starts to unmount."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import pytest

import scripted_model as sm
from fgchat.engine.core import EngineConfig
from fgchat.protocol.events import SamplingParams
from fgchat.tui.app import FgchatApp
from test_tui import SIZE, data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    return sm.build_scripted_model(tmp_path_factory.mktemp("tui") / "scripted", eos_in="generation_config")


async def reply_to(pilot, app: FgchatApp, text: str):
    conv = app.chats.current.conversation
    n = len(conv.messages)
    await type_prompt(pilot, text)
    await wait_for(pilot, lambda: len(conv.messages) == n + 2 and not app.replies, "the reply")
    return conv.messages[-1]


async def test_system_prompt_turns_and_eos_reach_the_engine_process(scripted, data_dir):
    """The engine process (the app's default handle) renders the chat as the template does:
    the system prompt "you are a pirate." gives "arr matey", also on the next turn (user,
    assistant, user: the template refuses any other order); a blank one gives "hello world".
    Each reply ends at <|im_end|> (declared in generation_config.json only): finish "stop",
    3 tokens, though 16 were allowed."""
    app = FgchatApp(EngineConfig(model=str(scripted), device="cpu", mode="eager", max_context=256),
                    sampling=SamplingParams(max_tokens=16))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        conv = app.chats.current.conversation
        conv.system_prompt = "you are a pirate."
        for prompt in ("hi", "tell me more"):
            reply = await reply_to(pilot, app, prompt)
            assert (reply.content, reply.meta["finish"], reply.meta["tokens"]) == ("arr matey", "stop", 3), prompt
        conv.system_prompt = ""
        reply = await reply_to(pilot, app, "hi")
        assert (reply.content, reply.meta["finish"], reply.meta["tokens"]) == ("hello world", "stop", 3)
        assert not [text for sev, text in app.notices if sev == "error"]


def stored_assistant_rows(path: Path) -> list[tuple[str, dict]]:
    """The assistant messages in the store's file, read through a connection of our own."""
    import json

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT content, meta FROM messages WHERE role = 'assistant' ORDER BY id").fetchall()
    finally:
        db.close()
    return [(content, json.loads(meta)) for content, meta in rows]


async def test_sigterm_stores_every_reply_in_flight_before_the_ui_unmounts(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=4000, thread=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        app.set_samples(2)
        await type_prompt(pilot, "Hello there")
        await wait_for(pilot, lambda: len(app.replies) == 2 and all(r.tokens >= 5 for r in app.replies.values()),
                       "two replies streaming")
        texts = {r.sample: r.bubble.text for r in app.replies.values()}
        tokens = {r.sample: r.tokens for r in app.replies.values()}
        # what the installed handler schedules on the loop; no await between it and the check
        app.exit_on_signal(signal.SIGTERM)
        rows = stored_assistant_rows(app.data_path / "chats.sqlite3")
        assert app.exit_signal == signal.SIGTERM and app.query_one("#prompt").is_mounted
        assert sorted((m["sample"], m["finish"], m["tokens"], content) for content, m in rows) == [
            (k, "interrupted", tokens[k], texts[k]) for k in (1, 2)]
        assert "2 replies in flight stored as interrupted" in (app.data_path / "ui.log").read_text()
