"""Decode attention for eager CPU steps: torch's scaled_dot_product_attention over the cache
window that holds every lane's tokens.

CPU steps are never captured in a graph, so this backend may use the host-side length bound
(max_len_hint) and the host's view of the slots. A lane with no positions (seq_len == 0) yields
zeros, as in the reference backend (torch_ref), which the tests compare this one with.

A half-precision cache is attended by one of two routes, chosen once per process and head shape
(`half_kernel_pays`, unless Tuning.cpu_attn_half sets it):
- float32: float32 copies of the lanes' windows and torch's float32 kernel. On 2 AMD EPYC vCPUs
  (AVX512-BF16, no AMX) torch's bf16 kernel took 60 / 277 / 1089 us a layer at 100 / 500 / 2000
  positions (SmolLM2's 9 q and 3 kv heads) where the copies and the float32 kernel took 41 / 107 /
  340 (design.md V62).
- half: torch's kernel on the cache's own dtype, reading the lane's positions where they lie. On 2
  Intel Xeon vCPUs with AMX it took 25 / 60 / 177 us at 100 / 1000 / 3000 positions where the
  float32 route took 49 / 177 / 606 (design.md V80).
Both keep float32 scores and softmax sums; rounded to the cache's dtype their outputs differ from a
float64 attention of the same inputs by the same amount (max relative error 2.3-2.5e-3 at 100-3000
positions, most of it the final rounding).

Several lanes share one call over a window padded to the longest lane, each shorter lane's tail in
the copies zeroed by one contiguous fill per lane (a masked position's value still enters the
product with weight 0, and a fresh cache may hold NaN there). From PER_LANE_WINDOW positions up
(float32 route) each lane's own positions are converted straight into the float32 window: fewer
bytes moved, more calls (embedded model, bf16, batch 8: -4.4 ms a step at ~1000 positions,
+0.5 ms at ~300; design.md V68). From HALF_PER_LANE_WINDOW up (half route) each lane is its own call
over its own positions: nothing copied, nothing masked.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from fgchat.engine.kernels.attention.base import (
    DecodeAttention,
    cache_heads_first,
    cache_window,
    check_decode_shapes,
)

PER_LANE_WINDOW = 512
# half route, batch 8: gathered window + mask 150 / 259 / 437 us, a call per lane 224 / 251 / 363
# at 128 / 256 / 512 positions (AMX Xeon, SmolLM2's heads)
HALF_PER_LANE_WINDOW = 256
# the probe `half_kernel_pays` times: positions of one lane, rounds, and how much faster the half
# kernel must be to be taken (the float32 route is the one measured on real weights, V62)
PROBE_POSITIONS = 1024
PROBE_ROUNDS = 5
HALF_MARGIN = 1.25


@functools.lru_cache(maxsize=None)
def half_kernel_pays(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether torch's CPU attention kernel on a `dtype` cache beats the float32 copies route by
    HALF_MARGIN on this machine: both routes timed on one lane of PROBE_POSITIONS random positions,
    alternating, median of PROBE_ROUNDS (~20 ms with the kernels' first calls, once per process and
    head shape)."""
    g = torch.Generator().manual_seed(0)
    n = PROBE_POSITIONS
    q = torch.randn(1, num_q_heads, 1, head_dim, generator=g).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype).transpose(0, 1)[None]
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype).transpose(0, 1)[None]
    gqa = num_q_heads != num_kv_heads

    def half() -> None:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    def single() -> None:
        F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=gqa)

    times: dict[str, list[float]] = {"half": [], "single": []}
    with torch.inference_mode():
        for _ in range(PROBE_ROUNDS + 1):  # the first round warms both and is dropped
            for name, run in (("half", half), ("single", single)):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["half"][1:]) * HALF_MARGIN <= statistics.median(times["single"][1:])


def _attend_lane(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot: int, n: int, out: Tensor, half: bool,
                 gqa: bool, scale: float, start: int = 0) -> None:
    """One lane ([1, Hq, D] q and out) over positions [start, n) of its slot, in the fewest calls
    (views of the cache; float32 copies of a half-precision one unless `half`); n <= start gives
    zeros."""
    if n <= start:
        out.zero_()
        return
    k, v = cache_heads_first(k_cache, slot, n, start), cache_heads_first(v_cache, slot, n, start)
    q4 = q.unsqueeze(2)
    if not half and k.dtype != torch.float32:
        q4, k, v = q4.float(), k.float(), v.float()
    out.unsqueeze(2).copy_(F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=gqa))


class SdpaDecodeAttention(DecodeAttention):
    name = "sdpa"

    def __init__(self, half_kernel: bool | None = None) -> None:
        """half_kernel: a half-precision cache is attended in its own dtype (True) or through
        float32 copies (False); None: whichever `half_kernel_pays` finds on this machine."""
        self.half_kernel = half_kernel

    def uses_half_kernel(self, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """The route a cache of `dtype` takes (float32 caches are attended as they are)."""
        if dtype == torch.float32:
            return False
        if self.half_kernel is None:
            self.half_kernel = half_kernel_pays(dtype, num_q_heads, num_kv_heads, head_dim)
        return self.half_kernel

    def label(self, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int) -> str:
        if dtype == torch.float32:
            return self.name
        half = self.uses_half_kernel(dtype, num_q_heads, num_kv_heads, head_dim)
        return f"{self.name} ({str(dtype).removeprefix('torch.') if half else 'float32 copies'})"

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_ids: Tensor,
        seq_lens: Tensor,
        out: Tensor,
        scale: float,
        max_len_hint: int | None = None,
        window: int = 0,
    ) -> None:
        batch, num_q_heads, num_kv_heads, head_dim, max_context = check_decode_shapes(
            q, k_cache, v_cache, slot_ids, seq_lens, out
        )
        if q.device.type != "cpu":
            raise ValueError("the sdpa decode backend serves CPU steps only")
        gqa = num_q_heads != num_kv_heads
        half = self.uses_half_kernel(k_cache.dtype, num_q_heads, num_kv_heads, head_dim)
        sliding, window = window, cache_window(max_context, max_len_hint)
        if batch == 1 or (half and window >= HALF_PER_LANE_WINDOW) or sliding > 0:
            # each lane's own positions, as views of its slot: nothing to mask
            for lane, (slot, n) in enumerate(zip(slot_ids.tolist(), seq_lens.tolist())):
                n = min(n, max_context)
                _attend_lane(q[lane:lane + 1], k_cache, v_cache, slot, n, out[lane:lane + 1],
                             half, gqa, scale, max(0, n - sliding) if sliding > 0 else 0)
            return
        # the kernel's dtype: .to() copies a half-precision tensor into float32, returns others as they are
        kdt = k_cache.dtype if half else torch.float32
        idx = slot_ids.long()
        lens = seq_lens.long()
        valid = torch.arange(window, device=q.device)[None, :] < lens[:, None]  # [B, W]
        # copies of the lanes' windows [B, W, Hkv, D]; positions past a lane's length may hold
        # anything (the CPU cache is not zeroed, a fresh buffer neither): each lane's tail is
        # zeroed before it can reach a product, one contiguous fill per lane (a broadcast
        # masked_fill over the whole window took 1.1 ms a call at 1000 positions, batch 8)
        if not half and window >= PER_LANE_WINDOW:
            k = torch.empty((batch, window, num_kv_heads, head_dim), dtype=torch.float32)
            v = torch.empty_like(k)
            for lane, (slot, n) in enumerate(zip(idx.tolist(), lens.tolist())):
                n = max(min(n, window), 0)
                k[lane, :n].copy_(k_cache[slot, :n])
                v[lane, :n].copy_(v_cache[slot, :n])
        else:
            k = k_cache[:, :window].index_select(0, idx).to(kdt)
            v = v_cache[:, :window].index_select(0, idx).to(kdt)
        for lane, n in enumerate(lens.tolist()):
            if n < window:
                k[lane, max(n, 0):].zero_()
                v[lane, max(n, 0):].zero_()
        result = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(kdt), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=gqa,
        ).view(batch, num_q_heads, head_dim)
        # a lane without positions has an all-False mask (NaN row): it attends to nothing
        out.copy_(torch.where((lens > 0)[:, None, None], result, torch.zeros((), dtype=result.dtype)))
