"""A quantized weight matrix in planes: the fields of the format's blocks, each field of every
block of a row gathered into one contiguous row-major tensor [N, ...] (structure of arrays).

The planes hold exactly the bits the file (or the quantizer) holds; only where the fields sit
changes, so the values are the file's. Every plane's first dimension is the output row n, so rows
can be selected or concatenated plane by plane. K is the input width (the logical weight is
[N, K], as the bf16 weight it stands for). A nibble plane `qs` [N, K/2] keeps the format's own
order: its byte t holds weights k_lo = 2P*(t // P) + t % P (low nibble) and k_lo + P (high
nibble), P being the format's nibble pair distance (PAIR below).

Formats and their planes (w: the weight's value at [n, k]; q: the stored integer):
- Q8_0  block 32:  d fp16 [N, K/32], qs int8 [N, K]                     w = d[k/32] * qs[k]
- Q4_0  block 32:  d fp16 [N, K/32], qs uint8 [N, K/2] (P 16)            w = d * (q - 8)
- Q4_1  block 32:  d, m fp16 [N, K/32], qs uint8 [N, K/2] (P 16)         w = d * q + m
- Q4_K  block 256: d, dmin fp16 [N, K/256]; sc, mn uint8 [N, K/32] (the 6-bit sub-block
        scales and mins, unpacked from the block's 12 bytes); qs uint8 [N, K/2] (P 32)
                                                      w = d * sc[k/32] * q - dmin * mn[k/32]
- Q5_K  block 256: as Q4_K, plus qh uint8 [N, K/8] (the block's 32 high-bit bytes): weight
        64c + l (l < 32) takes bit 2c of qh byte l of its block, 64c + 32 + l bit 2c + 1
                                                      w = d * sc * (q + 16 * hbit) - dmin * mn
- Q6_K  block 256: d fp16 [N, K/256], sc int8 [N, K/16], ql uint8 [N, K/2], qh uint8 [N, K/4]
        (the block's ql / qh bytes in order; llama.cpp's dequantize_row_q6_K says which 4 + 2
        bits make weight k)                           w = d * sc[k/16] * (q6 - 32)
- fp8   w float8_e4m3fn [N, K], scale float32 [N]     w = w * scale[n]  (per output channel)
- int4  group 128: scale bf16 [N, K/128], qs uint8 [N, K/2] (P 1)  w = scale * (q - 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# elements per block (int4: its group) and the nibble pair distance of the `qs` plane
BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "fp8": 1, "int4": 128}
PAIR = {"Q4_0": 16, "Q4_1": 16, "Q4_K": 32, "Q5_K": 32, "int4": 1}
# the formats GGUF files bring as they are; fp8 and int4 come from --quantize
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
QUANTIZE_FORMATS = ("fp8", "int4")


@dataclass
class QuantWeight:
    fmt: str  # a key of BLOCK
    shape: tuple[int, int]  # (N, K): the logical weight
    planes: dict[str, torch.Tensor]  # see the module docstring; all on one device
    # the dtype the weight stands for: what dequantizing it gives and the activations it meets
    dtype: torch.dtype = torch.bfloat16

    @property
    def device(self) -> torch.device:
        return next(iter(self.planes.values())).device

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (every plane)."""
        return sum(p.numel() * p.element_size() for p in self.planes.values())


@dataclass
class QuantStack:
    """Quantized weights of different formats stacked along N as one fused weight (a Q4_K_M
    file's q / k in Q4_K with v in Q6_K): part j holds output rows [offsets[j], offsets[j+1]).
    Every part has the same K and dtype."""

    parts: list[QuantWeight]

    def __post_init__(self) -> None:
        if not self.parts or len({(p.shape[1], p.dtype) for p in self.parts}) != 1:
            raise ValueError("a QuantStack needs parts of one K and one dtype")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def stack(parts: list[QuantWeight]) -> QuantWeight | QuantStack:
    """Parts stacked along N: adjacent parts of one format become one QuantWeight (their planes
    concatenated row-wise, which the planar layout allows); a QuantStack where formats differ."""
    merged: list[QuantWeight] = []
    for p in parts:
        last = merged[-1] if merged else None
        if last is not None and last.fmt == p.fmt and last.shape[1] == p.shape[1] and last.dtype == p.dtype:
            planes = {name: torch.cat((last.planes[name], p.planes[name])) for name in last.planes}
            merged[-1] = QuantWeight(p.fmt, (last.shape[0] + p.shape[0], p.shape[1]), planes, p.dtype)
        else:
            merged.append(p)
    return merged[0] if len(merged) == 1 else QuantStack(merged)
