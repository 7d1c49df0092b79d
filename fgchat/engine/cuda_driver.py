"""The CUDA driver library through ctypes, for what torch does not offer: the device's primary
context before torch is imported (engine.startup_prime), a compiled kernel's occupancy
(kernels.megakernel) and a graph's upload to the device.
Nothing here imports torch; ctypes drops the GIL for each foreign call."""

from __future__ import annotations

import ctypes

LIBRARY = "libcuda.so.1"


def open_driver(library: str = LIBRARY) -> ctypes.CDLL | None:
    """The driver library, or None where it cannot be loaded (no NVIDIA driver)."""
    try:
        return ctypes.CDLL(library)
    except OSError:
        return None


def upload_graph_execs(execs: list[int], stream: int, library: str = LIBRARY) -> None:
    """cuGraphUpload of each instantiated graph (cudaGraphExec_t handles) on `stream`; raises
    RuntimeError where the driver cannot be loaded or refuses one."""
    lib = open_driver(library)
    if lib is None:
        raise RuntimeError(f"cannot load {library}")
    for h in execs:
        rc = lib.cuGraphUpload(ctypes.c_void_p(h), ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuGraphUpload failed with CUresult {rc}")
