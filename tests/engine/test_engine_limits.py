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


BOMBS = {
    "center": "{{ ''|center(1000000000) }}",
    "center method": "{{ ''.center(1000000000) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "replace": "{{ ('a'*1000000)|replace('a', 'a'*1000) }}",
    "replace method": "{{ ('a'*1000000).replace('a', 'a'*1000) }}",
    "format": "{{ '%1000000000s'|format('') }}",
    "format method": "{{ '{:{w}}'.format('', w=1000000000) }}",
    "percent": "{{ '%*s' % (1000000000, '') }}",
    "join": "{{ ('x'*1000)|join('y'*100000) }}",
    "indent": "{{ 'abc'|indent(1000000000, true) }}",
    "tojson indent": "{{ {'a': 1}|tojson(indent=1000000000) }}",
    "concat doubling": "{% set ns = namespace(s='x'*3000000) %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "shared repr": "{% set ns = namespace(x=[]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
    "macro buffer": "{% macro m() %}{% for i in range(1000) %}{{ 'x'*4000000 }}{% endfor %}{% endmacro %}{{ m() }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_template_bomb_stops_before_it_takes_the_memory(tiny_llama, tmp_path, name):
    """Loading and rendering a bomb ends in the one-line error within 2 s, and the peak of what
    Python allocated meanwhile stays within 200 MB: the bound holds while the text is built."""
    import tracemalloc

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = BOMBS[name]
    cfg_path.write_text(json.dumps(cfg))
    for extra in model.glob("chat_template.jinja"):
        extra.unlink()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.monotonic()
        with pytest.raises(RequestError) as info:
            Tokenizer.from_dir(model).apply_chat_template([{"role": "user", "content": "hi"}])
        seconds = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert msg.startswith("chat template stopped: ") and "\n" not in msg
    assert seconds <= 2.0, f"{name}: {seconds:.1f} s"
    assert peak <= 200 * 2**20, f"{name}: {peak / 2**20:.0f} MB"
