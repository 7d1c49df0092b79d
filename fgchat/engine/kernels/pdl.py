"""Programmatic dependent launch (PDL) between the decode step's Triton kernels (sm_90+).

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still running. Invariant for every such kernel: each program calls `pdl_enter` before it writes
anything and before it reads what the kernel just before it wrote; before that call it may read
memory no kernel writes (weights, RoPE tables) and memory last written two or more launches
earlier. `pdl_enter` waits for the previous kernel to complete and flush, then lets the next kernel
launch, so a kernel starts only after its predecessor's programs have all passed their wait: every
launch before the predecessor is complete and visible by then. The order of the whole chain is the
stream order, captured graphs included.
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
