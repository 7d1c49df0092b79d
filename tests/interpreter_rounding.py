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
        import torch  # noqa: F401  (_bf16_bits needs it)
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
            return _bf16_bits(np.ascontiguousarray(data).view(np.float32))
        return original(data, src, dst, rounding_mode)

    convert._fgchat_rne = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert
    _install_bf16_dot(interpreter, tl)
    _install_bf16_arithmetic(interpreter, tl, np)
    return True


def _bf16_bits(values):
    """The bf16 bit patterns (uint16) of float32 values, rounded to nearest-even as the GPU does."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _bf16_values(data):
    """The float32 values (exact) that bf16 bit patterns hold."""
    import numpy as np

    return (np.ascontiguousarray(data).astype(np.uint32) << 16).view(np.float32)


def _install_bf16_dot(interpreter, tl) -> None:
    """tl.dot of bf16 operands: the interpreter multiplies their raw 16-bit patterns as integers;
    widen them to the float32 values they hold first (exact), as the GPU's products are."""
    builder = interpreter.InterpreterBuilder
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_fgchat_bf16", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_bf16_values(h.data), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._fgchat_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _install_bf16_arithmetic(interpreter, tl, np) -> None:
    """bf16 constants and bf16 add / subtract / multiply: the interpreter has no bf16 constant and
    applies the operators to the raw 16-bit patterns; compute on the float32 values they hold and
    round to bf16 (nearest-even), as the GPU's bf16 instructions do."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_fgchat_bf16_arith", False):
        return

    def get_bf16(self, v):
        return interpreter.TensorHandle(_bf16_bits([v]), tl.bfloat16)

    def wrap(name, op):
        original = getattr(builder, name)

        def run(self, lhs, rhs):
            if lhs.dtype.scalar == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
                return interpreter.TensorHandle(_bf16_bits(op(_bf16_values(lhs.data), _bf16_values(rhs.data))),
                                                tl.bfloat16)
            return original(self, lhs, rhs)

        setattr(builder, name, run)

    builder.get_bf16 = get_bf16
    for name, op in (("create_fadd", np.add), ("create_fsub", np.subtract), ("create_fmul", np.multiply)):
        wrap(name, op)
    builder._fgchat_bf16_arith = True
