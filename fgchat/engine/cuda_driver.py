"""The CUDA driver library through ctypes, for what torch does not offer: the device's primary
context before torch is imported (engine.startup_prime) and a compiled kernel's occupancy
(kernels.megakernel). Nothing here imports torch; ctypes drops the GIL for each foreign call."""

from __future__ import annotations

import ctypes

LIBRARY = "libcuda.so.1"


def open_driver(library: str = LIBRARY) -> ctypes.CDLL | None:
    """The driver library, or None where it cannot be loaded (no NVIDIA driver)."""
    try:
        return ctypes.CDLL(library)
    except OSError:
        return None
