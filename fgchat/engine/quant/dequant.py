"""The dense values of a quantized weight (qweight's planes), in vectorized torch: the reference
every quantized kernel is checked against, the CPU's copy of a quantized model, and the float32
reference forward's weights.

Invariant: in float32 each value is computed in the order gguf-py's dequantize_blocks (and
llama.cpp's dequantize_row_*) computes it, one float32 rounding per operation, so the result
equals theirs bit for bit: Q4_1 (d * q) + m; the K formats (d * sc) * q - (dmin * mn); Q6_K
(d * sc) * (q - 32).
"""

from __future__ import annotations

import torch

from fgchat.engine.quant.qweight import PAIR, QuantStack, QuantWeight

f32 = torch.float32


def unpack_nibbles(qs: torch.Tensor, pair: int) -> torch.Tensor:
    """The 4-bit values of a nibble plane qs [N, K/2] (pair distance `pair`) as uint8 [N, K]:
    byte t holds k = 2P*(t // P) + t % P (low nibble) and k + P (high nibble)."""
    n, half = qs.shape
    v = qs.view(n, half // pair, 1, pair)
    return torch.cat((v & 15, v >> 4), dim=2).reshape(n, 2 * half)


def _per_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """A per-block value x [N, K/block] repeated over its block's weights: [N, K]."""
    return x.repeat_interleave(block, dim=1)


def _k_scales(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the float32 sub-block factors d * sc and dmin * mn, [N, K/32]."""
    p = qw.planes
    d = _per_block(p["d"].to(f32), 8)
    dmin = _per_block(p["dmin"].to(f32), 8)
    return d * p["sc"].to(f32), dmin * p["mn"].to(f32)


def _q6(qw: QuantWeight) -> torch.Tensor:
    """Q6_K's 6-bit values [N, K] as int16 (0..63): in each 128 weights of a block (half h),
    weight 32s + l takes ql byte 64h + 32(s % 2) + l's nibble s // 2 and qh byte 32h + l's bits
    2s, 2s + 1."""
    ql, qh = qw.planes["ql"], qw.planes["qh"]
    n = ql.shape[0]
    lo = unpack_nibbles(ql, 64).view(n, -1, 4, 32)  # per half: s = 0..3, l
    hi = torch.stack([(qh >> (2 * s)) & 3 for s in range(4)], dim=1)  # [N, 4, K/4]
    hi = hi.view(n, 4, -1, 32).transpose(1, 2)  # [N, halves, 4, 32]
    return (lo.to(torch.int16) | (hi.to(torch.int16) << 4)).reshape(n, -1)


def _dequant_f32(qw: QuantWeight) -> torch.Tensor:
    fmt, p = qw.fmt, qw.planes
    if fmt == "Q8_0":
        return p["qs"].to(f32) * _per_block(p["d"].to(f32), 32)
    if fmt == "Q4_0":
        q = unpack_nibbles(p["qs"], PAIR[fmt]).to(torch.int8) - 8
        return _per_block(p["d"].to(f32), 32) * q.to(f32)
    if fmt == "Q4_1":
        q = unpack_nibbles(p["qs"], PAIR[fmt]).to(f32)
        return _per_block(p["d"].to(f32), 32) * q + _per_block(p["m"].to(f32), 32)
    if fmt in ("Q4_K", "Q5_K"):
        q = unpack_nibbles(p["qs"], PAIR[fmt])
        if fmt == "Q5_K":
            q = q | (_q5_high_bits(p["qh"]) << 4)
        dsc, dmn = _k_scales(qw)
        return _per_block(dsc, 32) * q.to(f32) - _per_block(dmn, 32)
    if fmt == "Q6_K":
        q = (_q6(qw) - 32).to(f32)
        dsc = _per_block(p["d"].to(f32), 16) * p["sc"].to(f32)
        return _per_block(dsc, 16) * q
    if fmt == "fp8":
        return p["w"].to(f32) * p["scale"].to(f32)[:, None]
    if fmt == "int4":
        q = unpack_nibbles(p["qs"], PAIR[fmt]).to(torch.int8) - 8
        return _per_block(p["scale"].to(f32), 128) * q.to(f32)
    raise ValueError(f"unknown quantized format {fmt!r}")


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_K's fifth bits [N, K] (uint8 0/1) from qh [N, K/8]: sub-block j (weights 32j..32j+31 of
    a block) takes bit j of the block's 32 qh bytes, in order."""
    n = qh.shape[0]
    v = qh.view(n, -1, 1, 32)  # [N, blocks, 1, l]
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8, 1)
    return ((v >> shifts) & 1).reshape(n, -1)


def dequantize(qw: QuantWeight | QuantStack, dtype: torch.dtype = f32) -> torch.Tensor:
    """The weight's values [N, K] in `dtype` (computed in float32, then rounded once)."""
    if isinstance(qw, QuantStack):
        return torch.cat([dequantize(p, dtype) for p in qw.parts], dim=0)
    n, k = qw.shape
    out = _dequant_f32(qw)
    if out.shape != (n, k):
        raise ValueError(f"{qw.fmt} planes give {tuple(out.shape)}, the weight is {(n, k)}")
    return out.to(dtype)


def take_rows(qw: QuantWeight, index: torch.Tensor | slice) -> QuantWeight:
    """The weight's rows `index` (a slice or an index tensor): every plane indexed along dim 0."""
    planes = {name: p[index] for name, p in qw.planes.items()}
    rows = next(iter(planes.values())).shape[0]
    return QuantWeight(qw.fmt, (rows, qw.shape[1]), planes)


def dense(w: torch.Tensor | QuantWeight | QuantStack, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a plain tensor of `dtype`: a plain one cast, a quantized one dequantized."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else dequantize(w, dtype)


def dense_rows(w: torch.Tensor | QuantWeight, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of a weight (an embedding lookup, a chunk of the LM head) as `dtype`."""
    if isinstance(w, torch.Tensor):
        return w[index].to(dtype)
    return dequantize(take_rows(w, index), dtype)
