"""What a model's weights are, in the words and numbers the user sees: the format ("bf16",
"Q4_1", "int4", a mixed file as "Q4_K+Q6_K"), the bytes they occupy, and the bytes one batch-1
decode step reads.

A weight is a torch.Tensor, a quantized matrix (any object with `.fmt` and `.nbytes`, e.g.
QuantWeight), or a stack of parts (any object with `.parts`, each part one of these). The fields
of DecoderWeights and LayerWeights are walked generically (dataclass fields), so a field added
later is counted without a change here; fields that hold no weight (None, numbers) are skipped.

Invariants:
- An object is counted once, however many fields hold it (a tied LM head is the embedding).
- The format names the projection matrices and the LM head only (norm vectors and biases are
  always float and small): their formats ordered by bytes, largest first, joined by "+".
- step_read_bytes(w) = every layer's weights + the final norm + the LM head: a decode step
  reads one row of the embedding table, which is not counted, even when the head is tied to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

# the names of float tensors' formats
FLOAT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def tensor_format(t: torch.Tensor) -> str:
    """"bf16", "fp16", "fp32", else the dtype's torch name (e.g. "float8_e4m3fn")."""
    return FLOAT_FORMATS.get(t.dtype) or str(t.dtype).removeprefix("torch.")


def _leaves(obj: Any) -> Iterator[tuple[str, int, Any]]:
    """(format, bytes, identity) of every stored piece of one weight; a stack yields its parts."""
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield tensor_format(obj), obj.numel() * obj.element_size(), _tensor_key(obj)
    elif hasattr(obj, "parts"):
        for part in obj.parts:
            yield from _leaves(part)
    elif hasattr(obj, "fmt") and hasattr(obj, "nbytes"):
        yield str(obj.fmt), int(obj.nbytes), id(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _leaves(item)


def _tensor_key(t: torch.Tensor) -> Any:
    """Two tensor objects over the same memory (views of one allocation) are one weight."""
    ptr = t.data_ptr() if t.device.type != "meta" else 0
    return (str(t.device), ptr, t.numel() * t.element_size(), t.dtype) if ptr else id(t)


def _is_vector(value: Any) -> bool:
    """A norm's weight or a bias: a float tensor of one dimension."""
    return isinstance(value, torch.Tensor) and value.dim() < 2


def _fields(obj: Any) -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(obj):
        yield f.name, getattr(obj, f.name)


def _step_weights(w: Any) -> Iterator[tuple[str, Any]]:
    """(field name, value) of every weight a decode step reads: each layer's fields, then the
    decoder's own fields but the embedding table and the layer list."""
    for layer in w.layers:
        yield from _fields(layer)
    for name, value in _fields(w):
        if name not in ("embed", "layers"):
            yield name, value


def _total(pairs: Iterator[tuple[str, Any]], seen: set[Any]) -> int:
    total = 0
    for _, value in pairs:
        for _, nbytes, key in _leaves(value):
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def step_read_bytes(w: Any) -> int:
    """Bytes a batch-1 decode step reads: all layers' weights, the final norm and the LM head
    (not the embedding table, of which a step reads one row)."""
    return _total(_step_weights(w), set())


def weight_bytes(w: Any) -> int:
    """Bytes every weight occupies: what a step reads plus the embedding table, an object held
    by several fields (a tied head) counted once."""
    seen: set[Any] = set()
    return _total(_step_weights(w), seen) + _total(iter([("embed", w.embed)]), seen)


def weight_format(w: Any) -> str:
    """The projections' and LM head's formats by bytes, largest first: "bf16", "Q4_1",
    "Q4_K+Q6_K"."""
    by_format: dict[str, int] = {}
    seen: set[Any] = set()
    for _, value in _step_weights(w):
        if _is_vector(value):
            continue
        for fmt, nbytes, key in _leaves(value):
            if key not in seen:
                seen.add(key)
                by_format[fmt] = by_format.get(fmt, 0) + nbytes
    if not by_format:  # no matrix at all: the embedding's format
        by_format = {fmt: n for fmt, n, _ in _leaves(w.embed)}
    return "+".join(sorted(by_format, key=lambda f: (-by_format[f], f)))
