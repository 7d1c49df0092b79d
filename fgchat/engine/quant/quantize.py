"""--quantize: fp8 and int4 weights made from a model's bf16 / fp16 (or float32) weights at load,
round-to-nearest, in qweight's layout.

- fp8: e4m3 values w / scale with one float32 scale per output row, scale = absmax / 448 (the
  largest e4m3 value); |dequantized - w| <= max(|w| / 16, scale * 2^-10) (half a step of e4m3's
  3-bit mantissa, or of its smallest subnormal step 2^-9).
- int4: groups of 128 along K, symmetric: scale = absmax / 7 rounded to bf16 (nearest even),
  q = round(w / scale) + 8 clamped to [0, 15]; |dequantized - w| <= scale / 2.
An all-zero row (fp8) or group (int4) gets scale 0 and dequantizes to zeros.
"""

from __future__ import annotations

import torch

from fgchat.engine.quant.qweight import BLOCK, QUANTIZE_FORMATS, QuantWeight

FP8_MAX = 448.0
INT4_MAX = 7


def quantize_fp8(w: torch.Tensor) -> QuantWeight:
    """w [N, K] as fp8 e4m3 with per-output-row float32 scales."""
    x = w.to(torch.float32)
    scale = x.abs().amax(dim=1) / FP8_MAX
    q = (x / _nonzero(scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantWeight("fp8", tuple(w.shape), {"w": q.contiguous(), "scale": scale.contiguous()}, w.dtype)


def quantize_int4(w: torch.Tensor) -> QuantWeight:
    """w [N, K] (K a multiple of 128) as int4 in groups of 128 with bf16 scales."""
    n, k = w.shape
    group = BLOCK["int4"]
    if k % group:
        raise ValueError(f"int4 needs an input width that is a multiple of {group}, not {k}")
    x = w.to(torch.float32).view(n, k // group, group)
    scale = (x.abs().amax(dim=2) / INT4_MAX).to(torch.bfloat16)
    s = scale.to(torch.float32)[:, :, None]
    q = (torch.round(x / _nonzero(s)) + 8).clamp(0, 15).to(torch.uint8)
    # pair distance 64 (qweight.PAIR): a group's byte t holds its weights t (low) and t + 64 (high)
    qs = (q[:, :, :64] | (q[:, :, 64:] << 4)).reshape(n, k // 2)
    return QuantWeight("int4", (n, k), {"scale": scale.contiguous(), "qs": qs.contiguous()}, w.dtype)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """The scale with zeros replaced by 1: a zero scale's weights are all zero, and 0 / 1 is 0."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """w [N, K] in `fmt` (one of qweight.QUANTIZE_FORMATS)."""
    if fmt == "fp8":
        return quantize_fp8(w)
    if fmt == "int4":
        return quantize_int4(w)
    raise ValueError(f"unknown --quantize format {fmt!r} (known: {', '.join(QUANTIZE_FORMATS)})")
