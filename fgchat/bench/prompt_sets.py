"""Chat prompt sets of `fgchat bench --prompts`: a built-in set (package data in bench/prompts/) or a
UTF-8 text file, one prompt per blank-line-separated block. Each prompt is a user message rendered
with the model's chat template by the engine's tokenizer, as the chat renders it; batch b takes
prompts 0..b-1 of the set (cycling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fgchat.protocol.errors import FgchatError

RANDOM = "random"  # random token ids of --prompt-len (prompts_for), no chat template
BUILTIN = ("grounded", "open")
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"


def split_prompts(text: str) -> list[str]:
    """The blocks of `text` between blank lines (lines of only whitespace count as blank); a block
    keeps its lines' indentation, their trailing whitespace is dropped."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip():
            blocks[-1].append(line.rstrip())
        elif blocks[-1]:
            blocks.append([])
    return ["\n".join(b) for b in blocks if b]


def prompt_texts(value: str) -> list[str]:
    """The prompts of --prompts `value` (a built-in set's name or a file's path); each failure is
    one line."""
    if value == RANDOM:
        raise ValueError("random prompts are token ids, not texts (spec.prompts_for)")
    path = PROMPTS_DIR / f"{value}.txt" if value in BUILTIN else Path(value).expanduser()
    where = f"--prompts {value}"
    if not path.exists():
        raise FgchatError(f"{where}: no such file (give {RANDOM}, {', '.join(BUILTIN)} or a text file of prompts)")
    if path.is_dir():
        raise FgchatError(f"{where}: is a directory (give a text file of prompts)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FgchatError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FgchatError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    prompts = split_prompts(text)
    if not prompts:
        raise FgchatError(f"{where}: no prompts in it (one prompt per blank-line-separated block)")
    return prompts


def render_prompts(tokenizer: Any, texts: list[str], name: str) -> list[list[int]]:
    """Each text as one user message through the chat template (the template's defaults, as the
    chat sends it), as prompt token ids."""
    out = []
    for i, text in enumerate(texts):
        try:
            out.append(list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True)))
        except FgchatError as e:
            raise FgchatError(f"--prompts {name}: prompt {i + 1}: {e}") from None
    return out


def check_has_tokenizer(value: str, random_weights: bool) -> None:
    """A set is rendered by the model's tokenizer: random weights (a preset's shape) have none."""
    if random_weights:
        raise FgchatError(f"--prompts {value} renders chat prompts with the model's tokenizer; random "
                          f"weights have none (use --prompts {RANDOM})")


def prompt_set_ids(model: str | None, preset: str | None, value: str) -> list[list[int]]:
    """The token ids of set `value` under `model`'s tokenizer (read before the engine is built: the
    prompts' lengths size its context)."""
    check_has_tokenizer(value, random_weights=preset is not None)
    from fgchat.engine.model.resolve import resolve_model
    from fgchat.engine.model.tokenizer import Tokenizer

    texts = prompt_texts(value)
    return render_prompts(Tokenizer.from_dir(resolve_model(model).path), texts, value)


def batch_prompts(ids: list[list[int]], batch: int) -> list[list[int]]:
    """Prompts 0..batch-1 of the set, cycling when the set has fewer."""
    return [list(ids[i % len(ids)]) for i in range(batch)]
