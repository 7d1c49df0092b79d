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
- int4  group 128: scale bf16 [N, K/128], qs uint8 [N, K/2] (P 64: byte t of a group holds
        its weights t and t + 64)                           w = scale * (q - 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# elements per block (int4: its group) and the nibble pair distance of the `qs` plane
BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "fp8": 1, "int4": 128}
PAIR = {"Q4_0": 16, "Q4_1": 16, "Q4_K": 32, "Q5_K": 32, "int4": 64}
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

    def to(self, device: torch.device | str) -> QuantWeight:
        """The same weight with every plane on `device` (the bits unchanged)."""
        return QuantWeight(self.fmt, self.shape, {k: p.to(device) for k, p in self.planes.items()}, self.dtype)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """The row concatenation of weights of one format, width and dtype: every plane concatenated
    along dim 0 (a fused q|k|v or gate|up weight)."""
    fmt, k, dtype = parts[0].fmt, parts[0].shape[1], parts[0].dtype
    if any(p.fmt != fmt or p.shape[1] != k or p.dtype != dtype for p in parts):
        raise ValueError(f"cat_rows needs one format and width: {[(p.fmt, p.shape) for p in parts]}")
    planes = {name: torch.cat([p.planes[name] for p in parts], dim=0) for name in parts[0].planes}
    return QuantWeight(fmt, (sum(p.shape[0] for p in parts), k), planes, dtype)


@dataclass
class QuantStack:
    """Rows of weights of different formats stacked (a Q4_K_M file's Q4_K q, k with a Q6_K v):
    part i owns rows [offsets[i], offsets[i + 1]) of the logical weight [N, K]; a product runs
    one launch per part into its slice of the output columns. Every part has the same K and
    dtype; adjacent parts differ in format (stack_rows merges runs of one format)."""

    parts: list[QuantWeight]

    def __post_init__(self) -> None:
        if not self.parts or len({(p.shape[1], p.dtype) for p in self.parts}) != 1:
            raise ValueError("a QuantStack needs parts of one K and one dtype")

    @property
    def fmt(self) -> str:
        return "+".join(p.fmt for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for p in self.parts:
            out.append(out[-1] + p.shape[0])
        return out

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device: torch.device | str) -> QuantStack:
        return QuantStack([p.to(device) for p in self.parts])


def row_parts(w: QuantWeight | QuantStack) -> list[tuple[int, QuantWeight]]:
    """(first output row, part) of each part of w (a QuantWeight is its own one part)."""
    if isinstance(w, QuantWeight):
        return [(0, w)]
    return list(zip(w.offsets, w.parts))


def stack_rows(parts: list[QuantWeight]) -> QuantWeight | QuantStack:
    """The row concatenation of `parts` (one width): a QuantWeight when they share a format, else
    a QuantStack of the runs of one format (cat_rows of each run)."""
    if any(p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError(f"stack_rows needs one width: {[p.shape for p in parts]}")
    runs: list[list[QuantWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [cat_rows(r) if len(r) > 1 else r[0] for r in runs]
    return merged[0] if len(merged) == 1 else QuantStack(merged)
