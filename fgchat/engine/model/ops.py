"""The plain torch operations of the decoder that prefill, the fused stages and the float32
reference share: RMSNorm, RoPE and the LM head's float32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Float32 bytes of LM-head rows upcast per mm on CPU (half-precision weights). SmolLM2's [49152, 576]
# bf16 / fp16 head on 2 Zen 4 cores: 4.3 ms a call in 9.4 MB blocks, 7.8-9.3 ms in 19 MB blocks,
# 41 ms as one float32 copy.
HEAD_BLOCK_BYTES = 8 << 20


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with statistics in float32, the weight applied in the input dtype (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def head_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """LM head as float32 logits [N, V] from float32 sums that are never rounded to x's dtype:
    bf16 logits near 25 step by 0.125, which turns near ties into exact ties (argmax then picks
    the lower token id). cuBLAS writes float32 directly where torch offers it (CUDA)."""
    if x.dtype == torch.float32:
        return F.linear(x, w)
    if x.is_cuda:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch: upcast instead
            return F.linear(x.float(), w.float())
    # CPU has no mixed-dtype mm: w is upcast a block of rows at a time, each block still in cache
    # when its mm reads it, instead of as one float32 copy of the whole head per call.
    xf = x.float()
    rows = max(1, HEAD_BLOCK_BYTES // (4 * w.shape[1]))
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    for start in range(0, w.shape[0], rows):
        torch.mm(xf, w[start:start + rows].float().t(), out=out[:, start:start + rows])
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, D] in x's dtype."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
