"""Tokenizer on top of the `tokenizers` library plus Hugging Face chat templates (jinja2).

Deliberately does not import transformers: start-up must stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fgchat.engine.model.chat_template import TemplateBudgetError, compile_template, render_bounded
from fgchat.protocol.errors import ModelLoadError, RequestError

# Used when a model ships no chat template (and written by GGUF conversion when one is lost).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_END = "<|im_end|>"
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Encode/decode text and render chat prompts for one model directory."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_ids: set[int] | None = None,
        bos_id: int | None = None,
        adds_bos: bool = False,
    ) -> None:
        """`backend` is a `tokenizers.Tokenizer`; `special_tokens` maps bos_token/eos_token/... to strings."""
        backend.no_truncation()  # invariant: encode never drops or pads tokens behind our back
        backend.no_padding()
        self._tok = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_id = bos_id
        # True when the tokenizer's own encoding starts with BOS (so a chat prompt should too).
        self.adds_bos = adds_bos and bos_id is not None
        self.has_chat_template = chat_template is not None
        self.chat_template: str = chat_template if chat_template is not None else CHATML_TEMPLATE
        self.eos_ids: set[int] = set(eos_ids or ())
        if not self.has_chat_template and (end := backend.token_to_id(CHATML_END)) is not None:
            self.eos_ids.add(end)  # the fallback format ends each turn with <|im_end|>
        self._template = _compile_template(self.chat_template)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat template files and EOS ids from `path`."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {path} (only 'fast' tokenizers are supported)")
        try:
            backend = Backend.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a plain Exception on bad files
            raise ModelLoadError(f"invalid {tok_file}: {_one_line(e)}") from None
        tcfg = _read_json(path / "tokenizer_config.json")
        special = _special_tokens(tcfg)
        bos_id = _bos_id(backend, special.get("bos_token"), _read_json(path / "config.json"))
        return cls(
            backend,
            chat_template=_read_chat_template(path, tcfg),
            special_tokens=special,
            eos_ids=collect_eos_ids(path, backend, special.get("eos_token")),
            bos_id=bos_id,
            adds_bos=_adds_bos(backend, bos_id, tcfg),
        )

    # ---------------------------------------------------------------- basics
    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` map to their ids."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ---------------------------------------------------------------- chat
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of `messages` as the model's chat template renders it."""
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return render_bounded(self._template, dict(
                messages=messages, add_generation_prompt=add_generation_prompt, **context))
        except TemplateBudgetError as e:
            raise RequestError(f"chat template stopped: {e}") from None
        except Exception as e:  # raise_exception, undefined values, bad message shapes
            raise RequestError(f"chat template rejected the conversation: {_one_line(e)}") from None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt ids for `messages`. BOS appears once: added only when the tokenizer adds one and
        the rendered template did not already start with it."""
        ids = self.encode(self.render_chat(messages, add_generation_prompt, **kwargs))
        if self.adds_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]  # adds_bos implies bos_id is set
        return ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `decode(all ids)`.

    Invariants: ids[prefix_offset:read_offset] decode to text that was already emitted, and
    prefix_offset/read_offset always sit on character boundaries (a delta is only emitted when the
    decoded window does not end in U+FFFD, i.e. no multi-byte character is cut). Decoding a window
    that starts a little before the new ids keeps leading spaces exact for tokenizers that strip
    the space of the first token. Special tokens are skipped.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids_tail: list[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids_tail or [])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one id; returns the text it completes (possibly "" while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # hold back: nothing visible yet, or a multi-byte character is still partial
        return self._advance(prefix_text, new_text)

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. a trailing invalid byte sequence)."""
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._advance(prefix_text, new_text)

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        split = self._read_offset - self._prefix_offset
        decode = self._tokenizer.decode
        return decode(window[:split]), decode(window)

    def _advance(self, prefix_text: str, new_text: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


# -------------------------------------------------------------------- helpers
def collect_eos_ids(model_dir: Path, backend: Any, eos_token: str | None) -> set[int]:
    """Union of every EOS the model declares: config.json, generation_config.json, tokenizer eos."""
    ids = _as_id_set(_read_json(Path(model_dir) / "config.json").get("eos_token_id"))
    try:  # an unreadable generation_config.json is reported by generation_config.read, not fatal
        ids |= _as_id_set(_read_json(Path(model_dir) / "generation_config.json").get("eos_token_id"))
    except ModelLoadError:
        pass
    if eos_token is not None and (eos := backend.token_to_id(eos_token)) is not None:
        ids.add(eos)
    return ids


def _as_id_set(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _token_str(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(tcfg: dict[str, Any]) -> dict[str, str]:
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: s for n in names if (s := _token_str(tcfg.get(n))) is not None}


def _bos_id(backend: Any, bos_token: str | None, config: dict[str, Any]) -> int | None:
    if bos_token is not None and (bid := backend.token_to_id(bos_token)) is not None:
        return int(bid)
    bid = config.get("bos_token_id")
    return bid if isinstance(bid, int) and not isinstance(bid, bool) else None


def _adds_bos(backend: Any, bos_id: int | None, tcfg: dict[str, Any]) -> bool:
    """Whether plain encoding of this tokenizer starts with BOS (post-processor or add_bos_token)."""
    if bos_id is None:
        return False
    if tcfg.get("add_bos_token") is True:
        return True
    return list(backend.encode("", add_special_tokens=True).ids[:1]) == [bos_id]


def _read_chat_template(model_dir: Path, tcfg: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's chat_template.

    A template may be a string or a list of {name, template}; "default" wins, else the first.
    """
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {jinja_file}: {_one_line(e)}") from None
    for value in (_read_json(model_dir / "chat_template.json").get("chat_template"), tcfg.get("chat_template")):
        if (template := _pick_template(value)) is not None:
            return template
    return None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError

    try:
        return compile_template(source)
    except TemplateError as e:
        raise ModelLoadError(f"invalid chat template: {_one_line(e)}") from None


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON object file: missing -> {}; present but invalid -> ModelLoadError."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"invalid {path}: {_one_line(e)}") from None
    return data if isinstance(data, dict) else {}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
