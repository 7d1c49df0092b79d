"""Integer helpers for launch shapes, in plain Python (no torch or triton import).

`triton.cdiv` / `triton.next_power_of_2` go through Triton's constexpr-function wrapper, which
costs microseconds per call on the per-launch host path; these do not.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 << max(0, n - 1).bit_length()
