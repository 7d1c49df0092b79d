"""Chat templates of the kinds Qwen3 and Gemma 3 ship (written here, not copied): one that reads
`enable_thinking`, one without a system role that folds the system prompt into the first user
turn. fgchat renders them as transformers' apply_chat_template does, and the engine's chat
command passes enable_thinking through (SubmitChats.enable_thinking)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import tiny_models
from fgchat.engine.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

THINKING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
NO_SYSTEM = (
    "{%- if messages[0].role == 'system' %}{%- set first = messages[0].content + '\n\n' %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for m in turns %}{%- if (m.role == 'user') != loop.index0 is even %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{%- endif %}"
    "<|im_start|>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{%- if loop.first %}{{ first }}{%- endif %}{{ m.content | trim }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>model\n{%- endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": " I am fine. "}, {"role": "user", "content": "The capital of France?"}]


def _dir(tmp_path, template: str):
    out = tmp_path / "tok"
    tiny_models.build_tokenizer(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _hf(path, messages, **kw) -> tuple[str, list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return text, tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("thinking", [None, True, False])
def test_enable_thinking_renders_as_transformers(tmp_path, thinking):
    path = _dir(tmp_path, THINKING)
    kw = {} if thinking is None else {"enable_thinking": thinking}
    ours = Tokenizer.from_dir(path)
    text, ids = _hf(path, CHAT, **kw)
    assert ours.render_chat(CHAT, **kw) == text
    assert ours.apply_chat_template(CHAT, **kw) == ids
    assert ("<think>" in text) == (thinking is False)


def test_a_template_without_a_system_role_folds_it_into_the_first_turn(tmp_path):
    path = _dir(tmp_path, NO_SYSTEM)
    ours = Tokenizer.from_dir(path)
    for messages in (CHAT, CHAT[1:]):
        text, ids = _hf(path, messages)
        assert ours.render_chat(messages) == text
        assert ours.apply_chat_template(messages) == ids
    assert "<|im_start|>system" not in ours.render_chat(CHAT)
    assert "Be brief.\n\nHello there!" in ours.render_chat(CHAT)


def test_the_chat_command_passes_enable_thinking_to_the_template(tmp_path):
    from fgchat.engine.commands import SubmitChats
    from fgchat.engine.serve_loop import _chat_ids

    path = _dir(tmp_path, THINKING)
    engine = SimpleNamespace(tokenizer=Tokenizer.from_dir(path))
    default = _chat_ids(engine, CHAT, SubmitChats(CHAT, ()).enable_thinking)  # None: the template's default
    assert _chat_ids(engine, CHAT, True) == default == _hf(path, CHAT)[1]
    assert _chat_ids(engine, CHAT, False) == _hf(path, CHAT, enable_thinking=False)[1] != default
