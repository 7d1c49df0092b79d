"""The plain path's embedding, products and LM head over a dense or a quantized weight.

Dense weights take torch's ops (CPU and CUDA); quantized ones exist only on CUDA (the CPU holds
dequantized copies) and take the Triton kernels (kernels.qgemv), imported only then, so a CPU
install never imports Triton here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fgchat.engine.model.ops import head_logits


def embedding(ids: torch.Tensor, w: object) -> torch.Tensor:
    """F.embedding of `ids` over a dense or quantized embedding table."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    from fgchat.engine.kernels import qgemv

    return qgemv.embedding(ids, w)


def linear(x: torch.Tensor, w: object, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a dense or quantized weight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    from fgchat.engine.kernels import qgemv

    return qgemv.linear(x, w, bias)


def logits(x: torch.Tensor, w: object, pdl: bool = False) -> torch.Tensor:
    """Float32 logits of normed rows x over a dense or quantized LM head (ops.head_logits); a
    quantized head's skinny kernel launches with PDL where `pdl` (the fused stages' chain)."""
    if isinstance(w, torch.Tensor):
        return head_logits(x, w)
    from fgchat.engine.kernels import qgemv, qtiles

    if x.shape[0] <= qgemv.MAX_TILED_ROWS:
        return qgemv.project_logits(x.contiguous(), w, pdl=pdl)
    return head_logits(x, qtiles.dequantize(w, x.dtype))
