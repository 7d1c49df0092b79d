"""The plain torch operations of the decoder that prefill, the fused stages and the float32
reference share: RMSNorm, RoPE and the LM head's float32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fgchat.engine.model.cpu_linear import pack, packed_linear

# Float32 bytes of LM-head rows upcast per mm on CPU (half-precision weights, no packed head).
# SmolLM2's [49152, 576] bf16 head on 2 AMD EPYC cores: ~4.5 ms a call in 8 MB blocks (19 MB blocks
# 7.8-9.3 ms; one float32 copy of the whole head 41 ms).
HEAD_BLOCK_BYTES = 8 << 20
# The largest head (float32 bytes) CpuHead keeps a packed float32 copy of: Llama-3.2-1B's
# [128256, 2048] is 1.05e9.
HEAD_PACK_MAX_BYTES = 1 << 30


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with statistics in float32, the weight applied in the input dtype (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def head_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """LM head as float32 logits [N, V] from float32 sums that are never rounded to x's dtype:
    bf16 logits near 25 step by 0.125, which turns near ties into exact ties (argmax then picks
    the lower token id). cuBLAS writes float32 directly where torch offers it (CUDA); a decoder
    on CPU uses its CpuHead instead, which is faster."""
    if x.dtype == torch.float32:
        return F.linear(x, w)
    if x.is_cuda:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch: upcast instead
            return F.linear(x.float(), w.float())
    return blocked_head_logits(x, w, head_scratch(w))


def head_scratch(w: torch.Tensor) -> torch.Tensor:
    """The float32 block buffer blocked_head_logits upcasts a CPU half-precision head through."""
    rows = max(1, min(w.shape[0], HEAD_BLOCK_BYTES // (4 * w.shape[1])))
    return torch.empty(rows, w.shape[1], dtype=torch.float32, device=w.device)


def blocked_head_logits(x: torch.Tensor, w: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """CPU has no mixed-dtype mm: w is upcast a block of rows at a time into `scratch`, each
    block still in cache when its mm reads it."""
    rows = scratch.shape[0]
    xf = x.float()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    for start in range(0, w.shape[0], rows):
        block = scratch[:min(rows, w.shape[0] - start)]
        block.copy_(w[start:start + rows])
        torch.mm(xf, block.t(), out=out[:, start:start + block.shape[0]])
    return out


class CpuHead:
    """Float32 logits of an LM head on CPU (float32, bf16 or fp16 weights), prepared once per
    decoder.

    Where the head's float32 copy fits HEAD_PACK_MAX_BYTES and torch has oneDNN's packed linear
    (the kernels its CPU compiler uses), that copy is kept packed: one oneDNN call per step. The
    embedded model on 2 AMD EPYC cores: 3.8-4.0 ms a step at batch 1 and 4.1-4.4 at batch 8, where the
    blocked upcast of bf16 took 4.5 / 11.5 ms, and 26-34 ms in processes where its alternation of
    elementwise copies and MKL products ran slow (about half of them on this VM); float32 weights
    through F.linear (MKL) 9.8 ms at batch 1, packed 4.7. Otherwise, and if the packed product
    disagrees with the blocked one at preparation: F.linear for float32 weights,
    blocked_head_logits for half ones. Invariant: float32 sums of the weights, as head_logits."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.packed = self._pack(w) if 4 * w.numel() <= HEAD_PACK_MAX_BYTES else None
        half = w.dtype != torch.float32
        self.scratch = head_scratch(w) if self.packed is None and half else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x.float(), self.packed)
        if self.scratch is None:
            return F.linear(x.float(), self.w)
        return blocked_head_logits(x, self.w, self.scratch)

    @staticmethod
    def _pack(w: torch.Tensor) -> torch.Tensor | None:
        try:
            packed = pack(w.float())
            x = torch.linspace(-1.0, 1.0, w.shape[1]).to(w.dtype)[None]
            got = packed_linear(x.float(), packed)
            want = blocked_head_logits(x, w, head_scratch(w))
            tol = 1e-5 * float(want.abs().max()) + 1e-6
            return packed if got.shape == want.shape and float((got - want).abs().max()) <= tol else None
        except (RuntimeError, AttributeError, NotImplementedError):  # no oneDNN in this torch
            return None


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(D/2, -1) * signed_sin(sin)
    (the same products: negation is exact)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_rolled(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """apply_rope's values (the same roundings) with ssin = signed_sin(sin): one roll instead of
    a negation and a concatenation. x: [N, heads, D]; cos / ssin: [N, D] in x's dtype."""
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, -1) * ssin[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, D] in x's dtype."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
