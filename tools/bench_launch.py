"""Host time per Triton launch, plain `kernel[grid](...)` vs fgchat.engine.kernels.launch.fast and its
bound launches (needs CUDA).

Kernel: fused._add_rms_norm_kernel (bf16, with delta). Back-to-back launches, no sync inside the
timed loop, best of 7 repeats; see launch.measure_launch_us.

    python tools/bench_launch.py
"""

from __future__ import annotations

import torch

from fgchat.engine.kernels.launch_timing import measure_launch_us


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("_add_rms_norm_kernel: host time per launch (us)")
    print("(bound: FastLauncher.bind as launch lists replay it; tensors passed as tensors, then as addresses)")
    print(f"{'rows':>5} {'n_cols':>7} {'plain':>8} {'fast':>8} {'speedup':>8} {'bound,t':>8} {'bound,a':>8}")
    for rows, n_cols in ((1, 2048), (8, 2048), (1, 4096), (8, 8192)):
        r = measure_launch_us(rows=rows, n_cols=n_cols)
        print(f"{rows:>5} {n_cols:>7} {r['plain_us']:>8.2f} {r['fast_us']:>8.2f} {r['speedup']:>7.1f}x"
              f" {r['bound_tensors_us']:>8.2f} {r['bound_us']:>8.2f}")


if __name__ == "__main__":
    main()
