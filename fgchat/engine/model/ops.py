"""The plain torch operations of the decoder that prefill, the fused stages and the float32
reference share: RMSNorm, RoPE and the LM head's float32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
            pass
    return F.linear(x.float(), w.float())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, D] in x's dtype."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
