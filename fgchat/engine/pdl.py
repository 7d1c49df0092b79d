"""Programmatic dependent launch (PDL) between the decode step's Triton kernels (sm_90+).

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still running. Invariant for every such kernel: each program calls `pdl_enter` before it reads
anything an earlier kernel wrote and before it writes anything; before that call it may read
only memory no kernel writes (weights, RoPE tables). `pdl_enter` waits for the previous kernel to
complete and flush, so the order of the whole chain is the stream order, captured graphs included.
It then lets the next kernel launch early.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def supported(device) -> bool:
    """PDL needs an NVIDIA GPU of compute capability 9.0 or newer and Triton's GDC ops."""
    return gdc_wait is not None and sm90_or_newer(device)


def sm90_or_newer(device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (Hopper's launch and copy features)."""
    import torch

    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)
