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

from fgchat.protocol.config import MAX_BATCH
from fgchat.protocol.errors import FgchatError, is_out_of_memory
from fgchat.engine.model.config import ModelConfig

NUM_SLOTS = MAX_BATCH


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
    """Pick the context length: requested or the model's, capped by the model's limit and by
    memory. Returns (length, reason); a reason for a capped length says what capped it and what was
    asked, e.g. "requested 1000000000, capped to the model's maximum 2048"."""
    model_max, limit = cfg.max_position, "the model's maximum"
    if cfg.sliding_window and cfg.sliding_window < model_max:
        model_max, limit = cfg.sliding_window, "the model's sliding window"
    want = requested if requested is not None else model_max
    capped_by_model = want > model_max
    want = min(want, model_max)
    fit = max(budget_bytes // kv_bytes_per_token(cfg, dtype), 0)
    fit = (fit // 256) * 256
    got = min(want, max(fit, 256))  # never below 256 tokens for memory's sake
    if got == want:
        if capped_by_model:
            return want, f"requested {requested}, capped to {limit} {model_max}"
        return want, "requested" if requested is not None else "model default"
    asked = f"requested {requested}, " if requested is not None else ""
    return got, f"{asked}capped by {device.type} memory to {got} (model allows {model_max})"


class KVCache:
    def __init__(self, cfg: ModelConfig, max_context: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (NUM_SLOTS, max_context, cfg.num_kv_heads, cfg.head_dim)
        self.max_context = max_context
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        layers = cfg.num_layers
        try:
            # one allocation [2 x layers, *shape]: k[i] and v[i] are its contiguous views, so a copy
            # across every layer (copy_prefix) is one indexed write
            self.all = alloc((2 * layers, *shape), device=device, dtype=dtype)
            self.k = list(self.all[:layers].unbind(0))
            self.v = list(self.all[layers:].unbind(0))
        except Exception as exc:  # MemoryError, torch.OutOfMemoryError, CPU allocator RuntimeError
            if not is_out_of_memory(exc):
                raise
            self.k = self.v = []
            self.all = None
            raise FgchatError(
                f"not enough {device.type} memory for a KV cache of {max_context} tokens x {NUM_SLOTS} slots; "
                "lower --max-context"
            ) from None

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Positions [0, length) of slot `src` into each slot of `dst`, every layer, in one indexed
        write. Positions >= length of `dst` are left as they are."""
        if not dst:
            return
        index = torch.tensor(dst, dtype=torch.int64, device=self.all.device)
        self.all[:, index, :length] = self.all[:, src, :length].unsqueeze(1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
