"""Issue 21: a failed reply must not break a chat whose template insists on alternating roles.

`Conversation.prompt_messages()` keeps user/assistant alternating whatever failed (the stored
history stays as it was): unit tests over stored sequences, and a Pilot test with a real engine
on a tiny model whose chat template rejects non-alternating roles like Mistral's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tiny_models
from fgchat.engine.core import Engine
from fgchat.protocol.errors import RequestError
from fgchat.tui.store import Conversation, StoredMessage
from test_tui import SIZE, data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

SYSTEM = "You are a helpful assistant."
ALTERNATION_ERROR = "Conversation roles must alternate user/assistant/user/assistant/..."

# ChatML, but like Mistral's template: an optional system message, then roles must alternate
# user/assistant/... or the template raises
ALTERNATING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('" + ALTERNATION_ERROR + "') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def user(text: str) -> StoredMessage:
    return StoredMessage("user", text)


def reply(text: str, finish: str = "length", **meta) -> StoredMessage:
    return StoredMessage("assistant", text, {"finish": finish, **meta})


def failed(text: str = "") -> StoredMessage:
    return reply(text, "error", error="prompt has 9999 tokens but the context holds 256")


def assert_alternates(msgs: list[dict[str, str]], system: bool) -> None:
    roles = [m["role"] for m in msgs]
    if system:
        assert roles[0] == "system"
        roles = roles[1:]
    assert "system" not in roles
    assert roles, "at least one user turn"
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2), roles
    assert roles[-1] == "user"


SEQUENCES = {
    "failed before first token": (
        [user("a"), failed(), user("b")],
        [("user", "a\n\nb")],
    ),
    "no reply stored": (
        [user("a"), user("b")],
        [("user", "a\n\nb")],
    ),
    "partial cancelled reply kept": (
        [user("a"), reply("par", "cancelled"), user("b")],
        [("user", "a"), ("assistant", "par"), ("user", "b")],
    ),
    "partial failed reply kept": (
        [user("a"), failed("half a rep"), user("b")],
        [("user", "a"), ("assistant", "half a rep"), ("user", "b")],
    ),
    "empty and blank replies": (
        [user("a"), reply("", "stop"), user("b"), reply("  \n", "cancelled"), user("c")],
        [("user", "a\n\nb\n\nc")],
    ),
    "failure in the middle": (
        [user("a"), reply("A"), user("b"), failed(), user("c"), reply("C"), user("d")],
        [("user", "a"), ("assistant", "A"), ("user", "b\n\nc"), ("assistant", "C"), ("user", "d")],
    ),
    "engine death then no reply": (
        [user("a"), reply("A", "interrupted"), user("b"), user("c")],
        [("user", "a"), ("assistant", "A"), ("user", "b\n\nc")],
    ),
    "K=3, alts stored first, primary failed empty": (
        [user("a"), reply("x", sample=2, of=3, alt=True), reply("y", sample=3, of=3, alt=True),
         failed(), user("b")],
        [("user", "a\n\nb")],
    ),
    "K=2, primary kept, alt skipped": (
        [user("a"), reply("alt", sample=2, of=2, alt=True), reply("main", sample=1, of=2), user("b")],
        [("user", "a"), ("assistant", "main"), ("user", "b")],
    ),
    "K=2, primary missing, alt only": (
        [user("a"), reply("alt", sample=2, of=2, alt=True), user("b")],
        [("user", "a\n\nb")],
    ),
    "two assistant turns, leading assistant": (
        [reply("hello?"), user("a"), reply("A1"), reply("A2"), user("b")],
        [("user", "a"), ("assistant", "A1\n\nA2"), ("user", "b")],
    ),
}


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_prompt_messages_always_alternate(name, system):
    stored, expected = SEQUENCES[name]
    conv = Conversation("c1", system_prompt=SYSTEM if system else "  ", messages=list(stored))
    before = [(m.role, m.content, dict(m.meta)) for m in conv.messages]
    msgs = conv.prompt_messages()
    assert_alternates(msgs, system)
    want = ([{"role": "system", "content": SYSTEM}] if system else []) + [
        {"role": r, "content": c} for r, c in expected
    ]
    assert msgs == want
    # only the prompt view changes: the stored history is untouched
    assert [(m.role, m.content, dict(m.meta)) for m in conv.messages] == before


def test_alternating_template_rejects_what_it_should(tiny_alternating):
    """The test template behaves like Mistral's: it rejects two user turns in a row."""
    from fgchat.engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_alternating)
    assert tok.has_chat_template
    sys_ = {"role": "system", "content": SYSTEM}
    tok.render_chat([sys_, {"role": "user", "content": "a"}])
    with pytest.raises(RequestError, match="roles must alternate"):
        tok.render_chat([sys_, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    conv = Conversation("c", messages=[user("a"), failed(), user("b")])
    tok.render_chat(conv.prompt_messages())


# ---------------------------------------------------------------------------------------------


def alternating_model(out: Path) -> Path:
    path = tiny_models.build_model(out, "mistral", seed=7)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ALTERNATING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return path


@pytest.fixture(scope="module")
def tiny_alternating(tmp_path_factory) -> Path:
    return alternating_model(tmp_path_factory.mktemp("tiny_alternating"))


FIRST_FAILURE = "prompt has 9999 tokens but the context holds 256 (test: the first request fails)"


class FailFirstEngine(Engine):
    """Rejects its first request (before any token), like a prompt longer than the context."""

    failed_once = False

    def submit(self, prompt_ids, params=None, request_id=None):
        if not self.failed_once:
            self.failed_once = True
            raise RequestError(FIRST_FAILURE)
        return super().submit(prompt_ids, params, request_id)


async def test_failed_first_reply_keeps_alternating_chat_usable(tiny_alternating, data_dir):
    app = make_app(tiny_alternating, max_tokens=6, make_engine=FailFirstEngine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        conv = app.chats.current.conversation

        await type_prompt(pilot, "Hello there")
        await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies, "the failed reply")
        first = conv.messages[1]
        assert first.role == "assistant" and first.content == ""
        assert first.meta["finish"] == "error" and "test: the first request fails" in first.meta["error"]

        await type_prompt(pilot, "How are you today?")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies, "the second reply")
        await type_prompt(pilot, "The capital of France")
        await wait_for(pilot, lambda: len(conv.messages) == 6 and not app.replies, "the third reply")

        notices = [text for _sev, text in app.notices]
        assert not any("alternate" in text for text in notices), notices
        # the stored history shows what happened: the failed reply stays, empty
        assert [m.role for m in conv.messages] == ["user", "assistant"] * 3
        assert conv.messages[1] is first
        for m in conv.messages[3::2]:
            assert m.meta["finish"] == "length" and m.meta["tokens"] == 6 and m.content, m.meta
        # what goes to the engine alternates: the unanswered turn is merged into the next one
        assert conv.prompt_messages()[:4] == [
            {"role": "system", "content": conv.system_prompt},
            {"role": "user", "content": "Hello there\n\nHow are you today?"},
            {"role": "assistant", "content": conv.messages[3].content},
            {"role": "user", "content": "The capital of France"},
        ]
        # and the store holds the same history
        stored = app.store.load(conv.id)
        assert stored is not None
        assert [(m.role, m.content) for m in stored.messages] == [
            (m.role, m.content) for m in conv.messages
        ]
