"""glibc's malloc, tuned for a CPU engine: freed blocks of up to 32 MB stay in the process for the
next allocation instead of going back to the operating system.

A CPU prefill's activations are tensors of 1-50 MB (1,000-9,000 rows of 576-3,072 columns on the
embedded model). By default glibc serves each of those from a fresh mmap and unmaps it when freed
(or trims the heap's top), so the next tensor of that size faults in every 4 KB page again: a
[8000, 3072] bf16 product took 26 ms into a fresh output and 9 ms into a reused one. With the mmap
threshold at glibc's largest and the heap trimmed only past TRIM_THRESHOLD_BYTES of free space,
the pages of tensors up to 32 MB are reused (design.md V81). Larger blocks (the KV cache, weights, and
that 49 MB output) are still mapped and unmapped as before. The cost: memory freed after a large
prefill stays resident until `release_free_blocks` hands the heap's free pages back (the engine
does once it is idle after a prefill; the next prefill faults its pages in once, not at every
layer).

Process-wide, set once by a CPU engine (Tuning.cpu_malloc); a libc without `mallopt` (not glibc)
is left as it is.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_blocks() -> bool:
    """Sets the two thresholds; True when the C library took both."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)


def release_free_blocks() -> bool:
    """glibc's malloc_trim(0): the free pages anywhere in the heap go back to the OS (the blocks
    stay, to be faulted in again on their next use); True when some memory was released."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim(0) == 1
