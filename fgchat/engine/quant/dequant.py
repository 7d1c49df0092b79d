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


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Values [N, K] viewed by block: [N, K/block, block] (per-block factors broadcast over it)."""
    return x.view(x.shape[0], -1, block)


def _f(x: torch.Tensor) -> torch.Tensor:
    """A per-block plane [N, K/block] as float32 [N, K/block, 1]."""
    return x.to(f32)[:, :, None]


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
    n = qw.shape[0]
    if fmt == "Q8_0":
        out = _blocks(p["qs"].to(f32), 32) * _f(p["d"])
    elif fmt == "Q4_0":
        q = unpack_nibbles(p["qs"], PAIR[fmt]).to(torch.int8) - 8
        out = _f(p["d"]) * _blocks(q.to(f32), 32)
    elif fmt == "Q4_1":
        q = unpack_nibbles(p["qs"], PAIR[fmt]).to(f32)
        out = _f(p["d"]) * _blocks(q, 32) + _f(p["m"])
    elif fmt in ("Q4_K", "Q5_K"):
        q = unpack_nibbles(p["qs"], PAIR[fmt])
        if fmt == "Q5_K":
            q = q | (_q5_high_bits(p["qh"]) << 4)
        d, dmin = _f(p["d"]), _f(p["dmin"])  # [N, blocks, 1] against sc / mn [N, blocks, 8]
        dsc = (d * p["sc"].view(n, -1, 8).to(f32)).view(n, -1)
        dmn = (dmin * p["mn"].view(n, -1, 8).to(f32)).view(n, -1)
        out = _f(dsc) * _blocks(q.to(f32), 32) - _f(dmn)
    elif fmt == "Q6_K":
        q = (_q6(qw) - 32).to(f32)
        dsc = (_f(p["d"]) * p["sc"].view(n, -1, 16).to(f32)).view(n, -1)
        out = _f(dsc) * _blocks(q, 16)
    elif fmt == "fp8":
        out = p["w"].to(f32) * p["scale"].to(f32)[:, None]
    elif fmt == "int4":
        q = unpack_nibbles(p["qs"], PAIR[fmt]).to(torch.int8) - 8
        out = _f(p["scale"]) * _blocks(q.to(f32), 128)
    else:
        raise ValueError(f"unknown quantized format {fmt!r}")
    return out.reshape(n, -1)


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
