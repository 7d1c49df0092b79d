"""The gated MLP's activation inside Triton kernels (fused.silu_mul, the GLU epilogue of
gemv / qgemv): float32 in, float32 out, each as torch computes it in float32 before the result
is rounded to the model's dtype."""

from __future__ import annotations

import triton
import triton.language as tl

from fgchat.engine.kernels.sampling_triton import libdevice


@triton.jit
def gate_activation(g, GELU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(g) = g / (1 + e^-g), or with GELU torch's gelu(g, approximate="tanh") =
    0.5 g (1 + tanh(beta (g + kappa g^3))), beta = sqrt(2 / pi), kappa = 0.044715, in its order
    of operations. LIBDEVICE: libdevice's tanh (GPU); else tanh from exp (Triton's interpreter
    has no extern functions)."""
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        if LIBDEVICE:
            t = libdevice.tanh(inner)
        else:  # |inner| >= 15: tanh is +-1 in float32 (and exp stays finite)
            z = tl.minimum(tl.maximum(inner, -15.0), 15.0)
            t = 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0
        return 0.5 * g * (1.0 + t)
    else:
        return g / (1.0 + tl.exp(-g))
