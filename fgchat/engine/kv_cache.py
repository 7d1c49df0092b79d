"""Static KV cache: per layer one K and one V tensor [slots, max_context, kv_heads, head_dim].

Invariant: addresses never change after construction, so captured CUDA graphs stay valid.
Every attention backend reads only positions < seq_len of its own slot, or masks both the score
and the V row of any other position, so unwritten memory never reaches a sequence's output. On CPU
the cache is left uninitialised (zeroing gigabytes there costs seconds at start); on CUDA it is
zeroed (a memset of microseconds), so synthetic self-check steps that attend over positions no
sequence wrote still see finite values.
"""

from __future__ import annotations

import torch

from fgchat.engine.model.config import ModelConfig

NUM_SLOTS = 8


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, slots: int = NUM_SLOTS) -> int:
    """Bytes of K+V for one position across all layers and slots."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.kv_size * elem * slots


def choose_max_context(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    requested: int | None,
    budget_bytes: int,
) -> tuple[int, str]:
    """Pick the context length: requested or the model's, capped by memory. Returns (length, reason)."""
    model_max = cfg.max_position
    if cfg.sliding_window:
        model_max = min(model_max, cfg.sliding_window)
    want = requested if requested is not None else model_max
    want = min(want, model_max)
    fit = max(budget_bytes // kv_bytes_per_token(cfg, dtype), 0)
    fit = (fit // 256) * 256
    if want <= fit:
        src = "requested" if requested is not None else "model default"
        return want, f"{src}"
    return max(fit, 256), f"capped by memory (model allows {model_max})"


class KVCache:
    def __init__(
        self, cfg: ModelConfig, max_context: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (NUM_SLOTS, max_context, cfg.num_kv_heads, cfg.head_dim)
        self.max_context = max_context
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.k = [alloc(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [alloc(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
