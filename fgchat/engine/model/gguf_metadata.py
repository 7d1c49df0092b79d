"""transformers' GGUF metadata read during a conversion, bounded by the file's size on every
transformers version pyproject allows.

- load_gguf_checkpoint without tensors (a Python object per vocabulary entry, ~7 s for Llama 3's
  128k) runs once per file although the tokenizer and the config each ask for it. Several
  transformers modules bind the function by name at import, so every binding of it in a loaded
  transformers module is replaced, not only the defining module's.
- A vocabulary without merges (sentencepiece "llama", Gemma): transformers versions that build
  their tokenizers through integrations.ggml.GGUFTokenizerSkeleton derive the merges with a list
  membership test per split, vocabulary-squared work (hours for 128k entries). The read's result
  then carries the merges, the very list that class would derive, in its order, in linear time.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
from collections.abc import Iterator
from typing import Any

# Modules that bind load_gguf_checkpoint by name at import in some supported transformers version.
_BINDERS = (
    "transformers.modeling_gguf_pytorch_utils",
    "transformers.configuration_utils",
    "transformers.tokenization_utils_fast",
    "transformers.tokenization_utils_tokenizers",
    "transformers.models.auto.tokenization_auto",
)


class MergePair(str):
    """A merge "left right" whose halves hold spaces themselves: split gives the two halves (the
    skeleton splits every given merge on " ")."""

    halves: tuple[str, str]

    def __new__(cls, left: str, right: str) -> MergePair:
        pair = super().__new__(cls, f"{left} {right}")
        pair.halves = (left, right)
        return pair

    def split(self, sep: Any = None, maxsplit: int = -1) -> list[str]:  # type: ignore[override]
        return list(self.halves)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return MergePair, self.halves


def derived_merges(tokens: list[str], scores: list[float]) -> list[str]:
    """The merges a vocabulary implies, in GGUFTokenizerSkeleton's order: every split of an entry
    into two entries; entries by descending score (ties: first appearance), the splits of one
    entry by descending (left score, right score) (ties: shorter left first). A token listed twice
    counts once, with the score of its last listing. Each merge is "left right" (a MergePair
    where a half holds a space)."""
    score = dict(zip(tokens, scores))
    found: list[tuple[str, str, float]] = []
    for token, token_score in score.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in score and b in score]
        splits.sort(key=lambda ab: (score[ab[0]], score[ab[1]]), reverse=True)
        found += [(a, b, token_score) for a, b in splits]
    found.sort(key=lambda m: m[2], reverse=True)
    return [MergePair(a, b) if " " in a or " " in b else f"{a} {b}" for a, b, _ in found]


def _derives_merges_itself() -> bool:
    """Whether this transformers builds GGUF tokenizers through GGUFTokenizerSkeleton, which
    derives missing merges in vocabulary-squared time."""
    try:
        ggml = importlib.import_module("transformers.integrations.ggml")
    except ImportError:
        return False
    return hasattr(ggml, "GGUFTokenizerSkeleton")


def _with_merges(result: Any) -> Any:
    """`result` (a metadata read) with the merges its tokenizer section implies, where it lists
    none and has tokens and scores."""
    tok = result.get("tokenizer") if isinstance(result, dict) else None
    if isinstance(tok, dict) and "merges" not in tok and "tokens" in tok and "scores" in tok:
        tok["merges"] = derived_merges(list(tok["tokens"]), list(tok["scores"]))
    return result


@contextlib.contextmanager
def metadata_read_once() -> Iterator[None]:
    """Inside, transformers' GGUF metadata read runs once per file, with merges filled in where
    this transformers would derive them itself (see the module doc); every caller gets its own
    deep copy of the one result."""
    for name in _BINDERS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    read = sys.modules["transformers.modeling_gguf_pytorch_utils"].load_gguf_checkpoint
    fill = _derives_merges_itself()
    done: dict[str, Any] = {}

    def once(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or any(v is not None for v in kwargs.values()):
            return read(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in done:
            result = read(path, return_tensors=False)
            done[str(path)] = _with_merges(result) if fill else result
        return copy.deepcopy(done[str(path)])

    bound = [m for n, m in list(sys.modules.items())
             if n.startswith("transformers") and getattr(m, "__dict__", {}).get("load_gguf_checkpoint") is read]
    for module in bound:
        module.load_gguf_checkpoint = once
    try:
        yield
    finally:
        for module in bound:
            module.load_gguf_checkpoint = read
