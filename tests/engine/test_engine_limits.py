"""Engine and tokenizer limits: duplicate request ids, bounded per-step history, chat templates
bounded in time and output (a template is code from the model repo)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from fgchat.engine import core
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.errors import RequestError
from fgchat.protocol.events import SamplingParams
from fgchat.engine.model.tokenizer import Tokenizer


def test_duplicate_request_id_is_refused(tiny_llama):
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=256))
    eng.submit([1, 2, 3], SamplingParams(max_tokens=4), request_id=7)
    with pytest.raises(RequestError, match="request id 7 is already in use"):
        eng.submit([4, 5, 6], SamplingParams(max_tokens=4), request_id=7)
    assert eng.cancel(7)
    eng.run_until_done()
    rid = eng.submit([4, 5, 6], SamplingParams(max_tokens=4), request_id=7)  # free again once finished
    assert rid == 7


def test_step_history_is_bounded(tiny_llama, monkeypatch):
    monkeypatch.setattr(core, "STEP_GRAPHS_KEPT", 16)
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_context=256))
    for _ in range(5):
        eng.submit([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
        eng.run_until_done()
    assert len(eng.step_graphs) == 16


@pytest.mark.parametrize("template,why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "longer than"),
    ("{{ 'a' * 10000000000 }}", "repetition"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "output passed"),
    ("{{ 10 ** 100000000 }}", "exponent"),
])
def test_hostile_chat_template_fails_the_request_in_one_line(tiny_llama, tmp_path, template, why):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    for extra in model.glob("chat_template.jinja"):
        extra.unlink()
    tok = Tokenizer.from_dir(model)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert why in msg and "\n" not in msg


def test_ordinary_template_renders_as_before(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    text = tok.render_chat([{"role": "user", "content": "hello"}])
    assert "hello" in text and len(text) < 200
