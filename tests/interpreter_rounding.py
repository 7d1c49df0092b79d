"""Make Triton's CPU interpreter round float32 -> bf16 to nearest-even, as the GPU does.

The interpreter (triton 3.x) truncates that conversion, so every bf16 result of a kernel run on CPU
carries a bias the GPU never has (seen here: a fused prefill picked another first token). Tests
that run kernels under TRITON_INTERPRET call `install()` first. Private API: when it is not there,
install() returns False and the caller skips its bf16 checks.
"""

from __future__ import annotations


def install() -> bool:
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        return False
    if getattr(original, "_fgchat_rne", False):
        return True

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16 and (rounding_mode is None or "RTNE" in str(rounding_mode)):
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    convert._fgchat_rne = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert
    return True
