"""The decoder's projections on CPU through oneDNN's packed linear: each weight reordered once
into oneDNN's blocked layout (the kernels torch's CPU compiler uses), one library call per product
instead of torch's F.linear (MKL for float32, an unpacked oneDNN call for bf16).

Measured on 2 AMD EPYC vCPUs (AVX512-BF16), SmolLM2-135M's shapes, 30 weights of a kind in turn,
us per product at 1 / 8 rows: float32 qkv 189 / 270 -> 85 / 97, gate/up 617 / 787 -> 297 / 331,
down 229 / 413 -> 149 / 169; bf16 qkv 78 / 98 -> 40 / 53, gate/up 224 / 280 -> 153 / 166, down
103 / 123 -> 63 / 80 (at 512 rows 3-20% faster). The bf16 products were equal bit for bit.

Invariants:
- Packing is per decoder, all layers or none, and only where it was checked: at preparation each
  weight shape's packed product of a probe row is compared with F.linear's (equal up to the sum
  order: float32 within 1e-5 of the largest value, half dtypes within one rounding step). A torch
  without oneDNN, a dtype it cannot pack, or a mismatch leave F.linear in place.
- The packed copies are extra memory (the dense weights stay for the float32 reference and the
  other paths): they are made only while they fit in 1 / PACK_RAM_SHARE of the machine's RAM.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import DecoderWeights

ROLES = ("qkv", "o", "gate_up", "down")
# rows oneDNN's layout is chosen for (its batch hint): the engine's largest decode batch
PACK_ROWS = 8
# packed copies may take at most this share of physical memory (1 / PACK_RAM_SHARE)
PACK_RAM_SHARE = 4


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def role_weight(lw, role: str) -> torch.Tensor:
    """A layer's projection weight by role ("qkv", "o", "gate_up", "down")."""
    return {"qkv": lw.wqkv, "o": lw.wo, "gate_up": lw.w_gate_up, "down": lw.w_down}[role]


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A packed product of a probe against F.linear's: same shape and dtype, finite, equal up to the
    sum order (float32 within 1e-5 of the largest value, half dtypes within one rounding step)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    g, w = got.float(), want.float()
    scale = float(w.abs().max()) + 1e-6
    tol = 1e-5 * scale if want.dtype == torch.float32 else torch.finfo(want.dtype).eps * scale
    return bool(torch.isfinite(g).all()) and float((g - w).abs().max()) <= tol


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in oneDNN's packed layout (an opaque tensor for `packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w^T (+ bias) with w packed by `pack`; x in w's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedProjections:
    """Layer i's packed weights by role; `linear(x, i, role, bias)` runs one product."""

    def __init__(self, layers: list[dict[str, torch.Tensor]]) -> None:
        self.layers = layers

    def linear(self, x: torch.Tensor, i: int, role: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        return packed_linear(x, self.layers[i][role], bias)

    @classmethod
    def prepare(cls, weights: DecoderWeights, budget_bytes: int | None = None) -> PackedProjections | None:
        """Packed copies of every layer's projections, or None where they cannot be used (see the
        module's invariants). budget_bytes: the most their copies may take (default: the RAM share)."""
        if weights.embed.device.type != "cpu" or not weights.layers:
            return None
        ws = [role_weight(lw, r) for lw in weights.layers for r in ROLES]
        need = sum(w.numel() * w.element_size() for w in ws)
        if budget_bytes is None:
            ram = physical_memory_bytes()
            budget_bytes = ram // PACK_RAM_SHARE if ram else 0
        if need > budget_bytes:
            return None
        try:
            checked: set[tuple] = set()
            layers = []
            for lw in weights.layers:
                packed = {}
                for role in ROLES:
                    w = role_weight(lw, role)
                    packed[role] = p = pack(w)
                    key = (tuple(w.shape), w.dtype)
                    if key not in checked:
                        probe = torch.linspace(-1.0, 1.0, w.shape[1]).to(w.dtype)[None]
                        if not agrees(packed_linear(probe, p), F.linear(probe, w)):
                            return None
                        checked.add(key)
                layers.append(packed)
        except (RuntimeError, AttributeError, NotImplementedError):  # no oneDNN, or not this dtype
            return None
        return cls(layers)
