"""Hopper bulk copies (TMA) for the projection kernel's weight tiles: which devices load by TMA,
and the host-side tensor descriptors of the weights.

A descriptor is fully determined by (address, shape, dtype, block shape): a cached one is valid
for any tensor with those four, so the cache needs no reference to the tensor itself (a freed
weight's entry describes only its old address and is never used unless a tensor of the same shape
and dtype lives there again, which it then describes exactly). Descriptors are built once per
weight; each launch still encodes its CUtensorMap on the host (Triton's launcher does), which a
captured graph does once.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fgchat.engine.kernels.pdl import sm90_or_newer

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without host tensor descriptors
    TensorDescriptor = None

# Tests set this to run TMA configs under Triton's interpreter (CPU tensors); devices never need it.
INTERPRETER = False
_CACHE_LIMIT = 4096
_descriptors: dict[tuple, Any] = {}
_capable: dict[int, bool] = {}  # sm90_or_newer per device index (each launch asks)


class _Address:
    """The base of a cached descriptor: what Triton reads from it (address, dtype), no tensor."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """Weight tiles may load by TMA on `device`: an NVIDIA GPU of compute capability 9.0+ (or
    the interpreter, where tests allow it)."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return INTERPRETER and _interpreting()
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capable.get(index)
    if ok is None:
        ok = _capable[index] = sm90_or_newer(torch.device("cuda", index))
    return ok


def weight_descriptor(w: torch.Tensor, block: tuple[int, int]) -> Any:
    """A descriptor of the contiguous 2-D weight w read in `block` tiles."""
    if not w.is_cuda:  # the interpreter reads the tensor through the descriptor
        return TensorDescriptor.from_tensor(w, list(block))
    key = (w.data_ptr(), w.shape[0], w.shape[1], w.dtype, block)
    desc = _descriptors.get(key)
    if desc is None:
        if len(_descriptors) >= _CACHE_LIMIT:
            _descriptors.clear()
        desc = TensorDescriptor(_Address(w.data_ptr(), w.dtype), [w.shape[0], w.shape[1]], [w.shape[1], 1],
                                list(block))
        _descriptors[key] = desc
    return desc
