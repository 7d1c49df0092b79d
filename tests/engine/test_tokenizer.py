"""Tokenizer, chat templates, EOS ids and the incremental detokenizer (tiny tokenizers built here)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from fgchat.protocol.errors import ModelLoadError, RequestError
from fgchat.engine.model.tokenizer import CHATML_TEMPLATE, IncrementalDetokenizer, Tokenizer
from tiny_models import SPECIAL, build_tokenizer

TEXTS = [
    "Hello there! How are you today?",
    "Ünïcödé text — naïve café, 東京, emoji 🙂 and more bytes.",
    "👍🏽👨‍👩‍👧 family 🇫🇷 flag, 漢字かなカナ 한국어, Ελληνικά, עברית",
    "  leading spaces and\ttabs\n\nnew lines   ",
    "def f(x):\n    return x * 2  # numbers 0123456789",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral plane 🀄 and combining e\u0301 a\u0308",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes: object) -> None:
    path = d / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


# ---------------------------------------------------------------- encode / decode
def test_encode_decode_roundtrip(tok: Tokenizer) -> None:
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_in_text_map_to_ids_and_are_skipped(tok: Tokenizer) -> None:
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == end
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


# ---------------------------------------------------------------- chat template
def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Capital of France?"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages) == expected
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(expected)
    assert ids[0] == tok.token_to_id("<|im_start|>")  # no BOS: this tokenizer declares none
    assert ids.count(tok.token_to_id("<|im_end|>")) == 4
    no_prompt = tok.render_chat(messages, add_generation_prompt=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")


def test_fallback_template_when_none_declared(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    _edit_config(d, chat_template=None)
    t = Tokenizer.from_dir(d)
    assert not t.has_chat_template
    assert t.render_chat([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert t.token_to_id("<|im_end|>") in t.eos_ids


def test_template_list_form_picks_default(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    _edit_config(
        d,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
        ],
    )
    assert Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "q"}]) == "DEFAULT q"


def test_template_files_take_precedence(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ messages|length }}"}))
    assert Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "q"}]) == "JSON 1"
    (d / "chat_template.jinja").write_text("JINJA {{ messages[0]['role'] }}")
    assert Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "q"}]) == "JINJA user"


def test_template_features_like_transformers(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    template = (
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'bad' %}{{ raise_exception('roles must be user or assistant') }}{% endif %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m | tojson }}{% endgeneration %}|\n"
        "{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ eos_token }}"
    )
    _edit_config(d, chat_template=template)
    t = Tokenizer.from_dir(d)
    out = t.render_chat([{"role": "user", "content": "é"}] * 3, add_generation_prompt=False)
    # trim_blocks/lstrip_blocks remove the indentation and newlines around block tags;
    # tojson does not escape non-ASCII; loop controls work.
    assert out == '{"role": "user", "content": "é"}|\n{"role": "user", "content": "é"}|\n4<|im_end|>'
    with pytest.raises(RequestError, match="roles must be user or assistant"):
        t.render_chat([{"role": "bad", "content": "x"}])


def test_invalid_template_is_a_load_error(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    _edit_config(d, chat_template="{% for m in messages %}")
    with pytest.raises(ModelLoadError, match="invalid chat template"):
        Tokenizer.from_dir(d)


def test_added_token_dicts_and_single_bos(tok_dir: Path, tmp_path: Path) -> None:
    """bos/eos given as AddedToken dicts; a tokenizer that adds BOS gets exactly one."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    d = _copy(tok_dir, tmp_path / "t")
    backend = Backend.from_file(str(d / "tokenizer.json"))
    bos = "<|endoftext|>"
    bos_id = backend.token_to_id(bos)
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    backend.save(str(d / "tokenizer.json"))
    _edit_config(
        d,
        bos_token={"content": bos, "lstrip": False, "rstrip": False, "special": True},
        eos_token={"content": "<|im_end|>", "special": True},
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    t = Tokenizer.from_dir(d)
    assert t.bos_token == bos and t.adds_bos and t.bos_id == bos_id
    assert t.eos_token == "<|im_end|>" and t.token_to_id("<|im_end|>") in t.eos_ids
    ids = t.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert ids[0] == bos_id and ids[1] != bos_id  # template wrote BOS: none added on top

    _edit_config(d, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids = Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "Hello"}])
    assert ids[0] == bos_id and ids[1] != bos_id  # template forgot BOS: the tokenizer's is added
    assert ids[1:] == t.encode("Hello")


# ---------------------------------------------------------------- EOS ids
def test_eos_ids_union_of_all_declarations(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    t0 = Tokenizer.from_dir(d)
    end, eot, start = (t0.token_to_id(s) for s in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"))
    assert t0.eos_ids == {end}  # tokenizer_config's eos_token only
    (d / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, 300]}))
    assert Tokenizer.from_dir(d).eos_ids == {end, eot, 300}
    (d / "config.json").write_text(json.dumps({"eos_token_id": [start, eot]}))
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_dir(d).eos_ids == {end, eot, start}


def test_missing_or_bad_tokenizer_files(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "t")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(d)


# ---------------------------------------------------------------- incremental detokenizer
def test_detokenizer_texts_exact_and_never_emit_partial_characters(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = _stream(IncrementalDetokenizer(tok), ids)
        assert "".join(deltas) == tok.decode(ids) == text
        # A valid text never shows U+FFFD: split multi-byte characters are held back until complete.
        assert all("\ufffd" not in delta for delta in deltas)


def test_detokenizer_random_ids_property(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    vocab = tok.vocab_size
    for _ in range(2000):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == tok.decode(ids), ids


def test_detokenizer_skips_specials_and_uses_prompt_tail(tok: Tokenizer) -> None:
    special = [tok.token_to_id(s) for s in SPECIAL]
    ids = tok.encode("Hello <|im_end|> wörld 🙂<|endoftext|>")
    assert any(i in special for i in ids)
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "Hello  wörld 🙂"
    tail, gen = tok.encode("The capital"), tok.encode(" of France is Paris.")
    deltas = _stream(IncrementalDetokenizer(tok, prompt_ids_tail=tail), gen)
    assert "".join(deltas) == tok.decode(tail + gen)[len(tok.decode(tail)) :] == " of France is Paris."


@pytest.fixture(scope="module")
def metaspace_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece-style tokenizer whose decoder drops the leading space of the first token:
    decoding tokens one at a time would lose spaces; the detokenizer's prefix window must not."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tiny_models import CORPUS

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(CORPUS + TEXTS, trainer)
    d = tmp_path_factory.mktemp("metaspace")
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(d)


def test_detokenizer_metaspace_leading_spaces(metaspace_tok: Tokenizer) -> None:
    t = metaspace_tok
    for text in ["Hello there! How are you", "The capital of France is Paris.", TEXTS[1]]:
        ids = t.encode(text)
        assert len(ids) > 3
        naive = "".join(t.decode([i]) for i in ids)
        expected = t.decode(ids)
        assert naive != expected  # per-token decoding really does drop spaces here
        assert "".join(_stream(IncrementalDetokenizer(t), ids)) == expected
    rng = random.Random(7)
    for _ in range(500):
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randint(1, 30))]
        assert "".join(_stream(IncrementalDetokenizer(t), ids)) == t.decode(ids), ids


def test_chatml_template_constant_matches_tiny_models() -> None:
    from tiny_models import CHATML_TEMPLATE as TINY

    assert CHATML_TEMPLATE == TINY


def test_render_matches_transformers(tok_dir: Path, tmp_path: Path) -> None:
    """transformers is the reference for chat-template rendering and prompt ids."""
    from transformers import AutoTokenizer

    d = _copy(tok_dir, tmp_path / "t")
    template = (
        "{% for m in messages %}\n"
        "  {% if loop.first and m['role'] != 'system' %}{{ '<|im_start|>system\\nDefault<|im_end|>\\n' }}{% endif %}\n"
        "  {{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    _edit_config(d, chat_template=template)
    ours = Tokenizer.from_dir(d)
    ref = AutoTokenizer.from_pretrained(str(d))
    for messages in (
        [{"role": "user", "content": " Hi 🙂 "}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "東京?"}, {"role": "assistant", "content": "ok"}],
    ):
        for gen in (True, False):
            text = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours.render_chat(messages, add_generation_prompt=gen) == text
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref.encode(text, add_special_tokens=False)
