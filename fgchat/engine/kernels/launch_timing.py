"""Host time per kernel launch: Triton's own `kernel[grid]` path against our FastLauncher, on the
add+RMSNorm kernel of the decode step (tests/kernels/test_launch.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fgchat.engine.kernels.launch import FastLauncher


def measure_launch_us(rows: int = 1, n_cols: int = 2048, dtype: torch.dtype = torch.bfloat16,
                      iters: int = 500, repeats: int = 7, device: str = "cuda") -> dict[str, float]:
    """Host time per launch (us) of `_add_rms_norm_kernel`: plain `kernel[grid]` vs `fast()`.

    Times `iters` back-to-back launches without synchronising (the GPU work of one launch is a few
    us, shorter than either launch path), best of `repeats`, after a warm-up that compiles and
    caches. Returns {"plain_us", "fast_us", "speedup", "bound_tensors_us", "bound_us"}: the last
    two are `FastLauncher.bind` launches (as eager's launch lists replay them) with the tensors
    passed as tensors, and as their addresses (the default). Needs CUDA.
    """
    import triton

    from fgchat.engine.kernels.fused import _add_rms_norm_kernel as kernel

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, n_cols, device=device, generator=g).to(dtype)
    d = torch.randn(rows, n_cols, device=device, generator=g).to(dtype)
    w = torch.rand(n_cols, device=device, generator=g).to(dtype)
    h_out, y = torch.empty_like(h), torch.empty_like(h)
    grid = (rows,)
    args = (h, d, w, h_out, y, n_cols, 1e-5, 0, w, 1.0)
    kw = dict(HAS_DELTA=True, BLOCK=triton.next_power_of_2(n_cols), num_warps=4 if n_cols <= 4096 else 8)
    launcher = FastLauncher(kernel)  # private instance: the counters below are ours alone

    def plain() -> None:
        kernel[grid](*args, **kw)

    def fast_() -> None:
        launcher[grid](*args, **kw)

    def per_launch_us(call: Callable[[], None]) -> float:
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
        return best / iters * 1e6

    for _ in range(3):
        plain()
        fast_()
    bound = launcher.bind(grid, *args, **kw)
    bound_tensors = launcher.bind(grid, *args, resolve_pointers=False, **kw)
    before = launcher.fast_launches
    plain_us, fast_us = per_launch_us(plain), per_launch_us(fast_)
    bound_tensors_us, bound_us = per_launch_us(bound_tensors), per_launch_us(bound)
    if launcher.fast_launches - before != 3 * iters * repeats:
        raise RuntimeError("fast launches fell back to the plain path; the timing is not meaningful")
    return {"plain_us": plain_us, "fast_us": fast_us, "speedup": plain_us / fast_us,
            "bound_tensors_us": bound_tensors_us, "bound_us": bound_us}
