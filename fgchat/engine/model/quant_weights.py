"""Quantized weights in DecoderWeights: fusing quantized rows, --quantize at load, the CPU's
dequantized copies (quant.describe names them and counts their bytes).

Invariants:
- Only the four projections of a layer (wqkv, wo, w_gate_up, w_down), the embedding and the LM
  head may be quantized; norms and biases stay plain tensors of the model dtype.
- A tied LM head is the embedding object itself, quantized or not, before and after any change
  made here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch

from fgchat.engine.quant.dequant import dense
from fgchat.engine.quant.qweight import QUANTIZE_FORMATS, QuantStack, QuantWeight, stack_rows
from fgchat.engine.quant.quantize import quantize

if TYPE_CHECKING:
    from fgchat.engine.model.config import ModelConfig
    from fgchat.engine.model.decoder import DecoderWeights

Weight = Union[torch.Tensor, QuantWeight, QuantStack]
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
QUANTIZE_CHOICES = ("none",) + QUANTIZE_FORMATS


def fuse(parts: list[torch.Tensor | QuantWeight], device: torch.device, dtype: torch.dtype) -> Weight:
    """The row concatenation of `parts` on `device`: plain tensors in `dtype`; quantized parts
    stay quantized (one format: a QuantWeight, several: a QuantStack); a mix of plain and
    quantized parts becomes plain (the quantized ones dequantized to `dtype`)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return stack_rows(parts).to(device)  # type: ignore[arg-type]
    plain = [dense(p, dtype) if isinstance(p, QuantWeight) else p for p in parts]
    t = plain[0] if len(plain) == 1 else torch.cat(plain, dim=0)
    return t.to(device=device, dtype=dtype).contiguous()


def check_quantize(cfg: ModelConfig, fmt: str) -> str | None:
    """Why `fmt` cannot quantize this model's projections (one line), or None when it can."""
    if fmt not in QUANTIZE_CHOICES:
        return f"unknown --quantize format '{fmt}' (choose from {', '.join(QUANTIZE_CHOICES)})"
    if fmt == "int4":
        widths = {cfg.hidden_size, cfg.q_size, cfg.intermediate_size}
        bad = sorted(w for w in widths if w % 128)
        if bad:
            return (f"--quantize int4 needs projection input widths that are multiples of 128 (its group); "
                    f"this model has {', '.join(map(str, bad))}: try --quantize fp8")
    return None


def quantize_projections(weights: DecoderWeights, fmt: str) -> None:
    """Replace every layer's four projections by `fmt` (quantize.quantize of the weight as it is
    held, on its device), layer by layer so the plain copies are freed as they go."""
    for lw in weights.layers:
        for name in PROJECTIONS:
            w = getattr(lw, name)
            if isinstance(w, torch.Tensor):
                setattr(lw, name, quantize(w, fmt))


def dequantize_all(weights: DecoderWeights, dtype: torch.dtype) -> bool:
    """Replace every quantized weight by its dequantized values in `dtype` (a tied head stays the
    embedding). Returns whether any weight was quantized."""
    found = False

    def plain(w: Weight) -> torch.Tensor:
        nonlocal found
        if isinstance(w, torch.Tensor):
            return w
        found = True
        return dense(w, dtype).contiguous()

    for lw in weights.layers:
        for name in PROJECTIONS:
            setattr(lw, name, plain(getattr(lw, name)))
    tied = weights.lm_head is weights.embed
    weights.embed = plain(weights.embed)
    weights.lm_head = weights.embed if tied else plain(weights.lm_head)
    return found
