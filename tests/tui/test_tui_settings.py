"""settings.json as a user may leave it: a value of the wrong type is ignored with one notice
naming its key (the app starts and works); a file that does not parse is never overwritten: it
is kept aside as settings.json.bad-<time>, named in a notice. Pilot with a real engine on the
tiny model."""

from __future__ import annotations

import json

import pytest

from fgchat.tui.store import DEFAULT_SYSTEM_PROMPT
from test_tui import SIZE, data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def warnings(app) -> list[str]:
    return [text for sev, text in app.notices if sev == "warning"]


async def reply_round(pilot, app) -> None:
    conv = app.chats.current.conversation
    await type_prompt(pilot, "hello")
    await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies, "a reply")
    assert conv.messages[-1].content


async def test_wrong_typed_settings_are_ignored_with_a_notice(tiny_llama, data_dir):
    data_dir.mkdir(parents=True)
    path = data_dir / "settings.json"
    path.write_text(json.dumps({"samples": "many", "system_prompt": 5, "theme": "textual-light"}))
    app = make_app(tiny_llama, thread=True, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        shown = warnings(app)
        assert len(shown) == 2, shown
        assert '"samples"' in shown[0] and '"system_prompt"' in shown[1]
        assert all("ignored" in text and "\n" not in text for text in shown)
        assert app.sampling.samples == 1 and app.theme == "textual-light"
        assert app.chats.current.conversation.system_prompt == DEFAULT_SYSTEM_PROMPT
        await reply_round(pilot, app)
        await pilot.press("f4")  # K + 1: saved; the other value is kept as the user wrote it
        await wait_for(pilot, lambda: app.sampling.samples == 2, "K = 2")
    saved = json.loads(path.read_text())
    assert saved["samples"] == 2 and saved["system_prompt"] == 5


async def test_unreadable_settings_are_kept_aside_never_overwritten(tiny_llama, data_dir):
    data_dir.mkdir(parents=True)
    path = data_dir / "settings.json"
    written = '{\n "system_prompt": "Answer like a pirate.",\n "samples": 3,\n}\n'  # trailing comma
    path.write_text(written)
    app = make_app(tiny_llama, thread=True, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        (aside,) = data_dir.glob("settings.json.bad-*")
        assert aside.read_text() == written
        (shown,) = warnings(app)
        assert str(aside) in shown and "settings.json could not be read" in shown and "\n" not in shown
        await reply_round(pilot, app)
        await pilot.press("f4")  # a change is saved in a new settings.json
        await wait_for(pilot, lambda: app.sampling.samples == 2, "K = 2")
    saved = json.loads(path.read_text())
    assert saved["samples"] == 2 and "system_prompt" not in saved
    assert aside.read_text() == written
