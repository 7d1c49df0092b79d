"""The decode-attention interface shared by every backend, plus shape checks and split planning.

One call computes attention for the current decode token of B batch lanes against ONE layer's
KV cache. Invariants every backend keeps:
- nothing here syncs with the host or branches on tensor *values*; only shapes steer Python code,
  so a call can be captured in a CUDA graph and replayed after slot_ids / seq_lens change in place;
- a lane reads cache positions [0, min(seq_len, T)) of slot slot_ids[lane] and nothing else, so
  garbage (even NaN) beyond seq_len or in other slots never reaches the output;
- a lane with seq_len == 0 (an idle lane) gets zeros, never NaN (torch and triton backends);
- with window > 0 (a sliding-window layer) a lane reads positions [max(0, seq_len - window),
  seq_len) only, the start derived from seq_len where the length is read (on the device for
  graph-captured backends), so a graph stays right as lengths pass the window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from fgchat.engine.intmath import cdiv


class DecodeAttention(ABC):
    """Single-token (decode) attention over a slotted KV cache. See the module docstring.

    Every optional capability is declared here; the engine reads these attributes and never
    probes a backend for methods:
    - `rope_in_attention`: `decode_with_rope` applies RoPE to the current token, writes its K/V
      into the cache and attends, in one call (same bits as RoPE + cache write, then `__call__`);
    - `pdl`: its kernels use programmatic dependent launch; `pdl_entry` (set by the engine) says
      whether its first kernel may start before the preceding kernel ends.
    """

    name: str = ""
    rope_in_attention: bool = False
    pdl: bool = False
    pdl_entry: bool = False

    @abstractmethod
    def __call__(
        self,
        q: Tensor,  # [B, Hq, D], RoPE applied
        k_cache: Tensor,  # [S, T, Hkv, D], one layer, contiguous
        v_cache: Tensor,  # [S, T, Hkv, D]
        slot_ids: Tensor,  # int32 [B] on the device: cache slot read by each lane
        seq_lens: Tensor,  # int32 [B] on the device: valid positions, current token included
        out: Tensor,  # [B, Hq, D], written in place
        scale: float,  # softmax scale, usually 1/sqrt(D)
        max_len_hint: int | None = None,  # host-side bound on seq_lens; eager only, may be ignored
        window: int = 0,  # > 0: attend to the last `window` positions only (see the module docstring)
    ) -> None: ...

    def for_blocks(self) -> DecodeAttention:
        """The backend for a verification step, where several lanes read rows of one slot that
        the kernel launched just before wrote (the other lanes' current rows, not only their
        own): this one where every read of the cache follows that kernel's end."""
        return self

    def label(self, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> str:
        """The backend as EngineInfo names it for a cache of `dtype` and these heads (a backend
        that picks among routes per machine names the one it takes)."""
        return self.name

    def decode_with_rope(
        self,
        qkv: Tensor,  # [B, (Hq + 2 Hkv) * D]: the current token's q | k | v rows before RoPE
        cos: Tensor,  # [T, D] RoPE tables in qkv's dtype
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_ids: Tensor,
        seq_lens: Tensor,
        out: Tensor,
        scale: float,
    ) -> None:
        """Only where `rope_in_attention` is True."""
        raise NotImplementedError(f"the {self.name} attention backend does not apply RoPE itself")


def cache_window(max_context: int, max_len_hint: int | None) -> int:
    """Cache positions an eager step needs to look at: the whole cache without a hint, else the
    hint clamped to [1, max_context] (positions past a lane's length are masked either way)."""
    return max_context if max_len_hint is None else max(1, min(int(max_len_hint), max_context))


def cache_heads_first(cache: Tensor, slot: int, t: int, start: int = 0) -> Tensor:
    """Rows [start, t) of one slot of a [S, T, Hkv, D] cache as a [1, Hkv, t - start, D] view, in
    one op."""
    s0, s1, s2, s3 = cache.stride()
    return cache.as_strided((1, cache.shape[2], t - start, cache.shape[3]), (s0, s2, s1, s3),
                            cache.storage_offset() + slot * s0 + start * s1)


def check_decode_shapes(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, seq_lens: Tensor, out: Tensor
) -> tuple[int, int, int, int, int]:
    """Validate shapes/dtypes (host metadata only, graph-safe). Returns (B, Hq, Hkv, D, T).

    Raises ValueError: a mismatch here is a programming error, not a user error.
    """
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, Hq, D] and k_cache [S, T, Hkv, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    batch, num_q_heads, head_dim = q.shape
    _, max_context, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) != head dim of the cache ({cache_head_dim})")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    for name, t in (("slot_ids", slot_ids), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != batch:
            raise ValueError(f"{name} must be int32 [{batch}], got {t.dtype} {tuple(t.shape)}")
    return batch, num_q_heads, num_kv_heads, head_dim, max_context


def plan_num_splits(
    batch: int,
    num_kv_heads: int,
    max_context: int,
    block_n: int,
    sm_count: int,
    programs_per_sm: int = 2,
    max_splits: int = 64,
) -> int:
    """Number of KV splits for a split-K decode kernel.

    Invariant (graph safety): depends only on shapes and the device's SM count, never on sequence
    lengths, so a graph captured at one length launches the same grid as an eager call at another.
    Aim: batch * num_kv_heads * splits ~= programs_per_sm * sm_count, with every split able to own
    at least one BLOCK_N tile of the longest possible sequence (max_context).
    """
    lanes = max(1, batch * num_kv_heads)
    want = cdiv(programs_per_sm * sm_count, lanes)
    return max(1, min(want, cdiv(max_context, block_n), max_splits))
