"""The prompt: a paste of several lines is sent whole, through the message editor (Pilot, real
engine, tiny model, CPU)."""

from __future__ import annotations

import pytest
from textual import events
from textual.widgets import TextArea

from fgchat.tui.dialogs import MessageScreen
from test_tui import data_dir, key, make_app, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)

SIZE = (120, 40)


async def test_multiline_paste_is_sent_whole(tiny_llama, data_dir, monkeypatch):
    app = make_app(tiny_llama, thread=True, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        prompt = app.query_one("#prompt")
        prompt.value = "Fix this: "
        prompt.cursor_position = len(prompt.value)

        # one line (a trailing newline included) goes into the prompt as before
        prompt.post_message(events.Paste("x = 1\n"))
        await wait_for(pilot, lambda: prompt.value == "Fix this: x = 1", "the one-line paste")

        # several lines open the editor with the prompt's text and all of the paste
        prompt.post_message(events.Paste("\ndef f(x):\r\n    return x\n"))
        await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen), "the message editor", 5)
        want = "Fix this: x = 1\ndef f(x):\n    return x"
        assert app.screen.query_one(TextArea).text == want
        assert prompt.value == "Fix this: x = 1"  # unchanged until the message is sent

        await key(pilot, "ctrl+s")
        conv = app.chats.current.conversation
        await wait_for(pilot, lambda: conv.messages and conv.messages[0].content == want, "the message sent")
        assert not isinstance(app.screen, MessageScreen) and prompt.value == ""
        await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies, "the reply")

        # a send the app refuses (the notification says why) opens the editor again with the text
        monkeypatch.setattr(app.link, "refusal", lambda: "the engine is restarting")
        prompt.post_message(events.Paste("one\ntwo"))
        await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen), "the message editor", 5)
        first = app.screen
        await key(pilot, "ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen) and app.screen is not first,
                       "the editor again", 5)
        assert app.screen.query_one(TextArea).text == "one\ntwo" and len(conv.messages) == 2
        assert any("the engine is restarting" in text for _, text in app.notices)
        monkeypatch.undo()
        await key(pilot, "ctrl+s")
        await wait_for(pilot, lambda: len(conv.messages) >= 3 and conv.messages[2].content == "one\ntwo",
                       "sent once the app takes it")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies, "the reply")

        # Esc cancels a paste: nothing sent, the prompt as it was
        prompt.value = "keep me"
        prompt.post_message(events.Paste("a\nb"))
        await wait_for(pilot, lambda: isinstance(app.screen, MessageScreen), "the message editor", 5)
        await key(pilot, "escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, MessageScreen), "cancelled", 5)
        assert prompt.value == "keep me" and len(conv.messages) == 4
