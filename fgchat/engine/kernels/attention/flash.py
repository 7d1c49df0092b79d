"""Optional backend: flash-attn's `flash_attn_with_kvcache` (FA2), or FA3's interface when only
that is installed. Imported lazily; never required.

Our cache layout [S, T, Hkv, D] is exactly flash-attn's (batch_cache, seqlen_cache, nheads_k, D);
`cache_batch_idx` maps lanes to slots and `cache_seqlens` bounds each lane, both read from device
memory (int32). FA2 picks its split count from shapes (T = k_cache.size(1), batch, heads, SMs),
not from cache_seqlens values, so the call is graph-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fgchat.engine.kernels.attention.base import DecodeAttention, check_decode_shapes
from fgchat.protocol.errors import FgchatError


def _import_flash_attn() -> tuple[Callable[..., Any], str]:
    """Return (flash_attn_with_kvcache, flavour). Raise FgchatError with one line if absent."""
    errors: list[str] = []
    try:
        from flash_attn import flash_attn_with_kvcache

        return flash_attn_with_kvcache, "fa2"
    except Exception as exc:  # ImportError, or an ABI mismatch surfacing as OSError/RuntimeError
        errors.append(f"flash_attn: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fa3_with_kvcache

        return fa3_with_kvcache, "fa3"
    except Exception as exc:
        errors.append(f"flash_attn_interface: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    raise FgchatError(
        "flash-attn is not importable (" + "; ".join(errors) + "); install fgchat[flash-attn] or use --attention triton"
    )


class FlashAttnDecode(DecodeAttention):
    name = "flash-attn"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise FgchatError("the flash-attn attention backend needs a CUDA device (use --attention torch)")
        self._fn, self.flavour = _import_flash_attn()

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_ids: Tensor,
        seq_lens: Tensor,
        out: Tensor,
        scale: float,
        max_len_hint: int | None = None,  # unused: flash-attn bounds each lane by cache_seqlens
        window: int = 0,
    ) -> None:
        batch, num_q_heads, _, head_dim, _ = check_decode_shapes(q, k_cache, v_cache, slot_ids, seq_lens, out)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash-attn needs fp16 or bf16, got {q.dtype}")
        # seqlen_q == 1: causal and non-causal coincide (the one query sees every cached position).
        result = self._fn(
            q.unsqueeze(1),  # [B, 1, Hq, D]
            k_cache,
            v_cache,
            cache_seqlens=seq_lens,
            cache_batch_idx=slot_ids,
            softmax_scale=scale,
            causal=True,
            # a sliding-window layer: the query at len - 1 sees keys [len - window, len - 1]
            **({"window_size": (window - 1, 0)} if window > 0 else {}),
        )
        if isinstance(result, tuple):  # some FA3 builds return (out, lse, ...)
            result = result[0]
        out.copy_(result.view(batch, num_q_heads, head_dim))
