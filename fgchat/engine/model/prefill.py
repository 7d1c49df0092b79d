"""Prefill: one prompt of T tokens through the decoder into its KV-cache slot (or, with
`prefill_after`, only the tokens after the rows a slot already holds: engine.prefix_reuse).

Two paths, chosen by `dec.fused`:
- unfused (CPU, or fused=False): plain torch ops, the reference the CPU tests compare with
  transformers; `prefill_many` runs several prompts in one pass (the engine's CPU admission);
- fused (CUDA with Triton): the decode stages' Triton kernels over all T rows — add_rms_norm
  (which also adds the previous sublayer's output into the residual), rope_kv_write (RoPE of q
  and k, and the K/V cache write) and silu_mul — so a layer is ~10 launches instead of ~40;
  `prefill_many_fused` runs several prompts in one pass (the engine's CUDA admission).

Attention is causal SDPA over the fresh k and v: k RoPE'd by the same kernel that writes the
cache, v a strided view of the qkv rows (no copies), so the slot is only ever a device index and a
prefill can be captured in a CUDA graph. In bf16/fp16 the grouped heads go to
SDPA as they are (enable_gqa=True): both fused CUDA backends that take grouped heads, flash
and cuDNN, are eligible for these views, and on an H200 with torch 2.11 the default dispatch
picks cuDNN's flash-style kernel (measured: ~8.5 us a layer at
T=512, as fast as flash forced, and no head expansion) at the bucketed lengths; elsewhere
`attention_backends` leaves cuDNN out (a plan per new shape). Float32 is eligible for neither, and
enable_gqa would fall back to the math backend, so there K/V heads are expanded first and the
efficient kernel runs.

No host syncs. The fused path pads the prompt to a bucket (PREFILL_BUCKETS) and reads the slot
and the last row from device tensors, so the same computation runs eagerly or as a captured graph
(engine.modes.prefill_graphs) with the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fgchat.engine.intmath import cdiv
from fgchat.engine.model import quant_ops
from fgchat.engine.model.ops import apply_rope_rolled, rms_norm

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def prefill(
    dec: Decoder,
    ids: torch.Tensor,
    slot: int,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    all_logits: bool = False,
    greedy: bool = False,
) -> torch.Tensor:
    """Positions 0..T-1 of cache slot `slot`; returns last logits [V] or all [T, V] (float32).
    greedy: the last logits serve an argmax only (see `head`)."""
    if dec.fused:
        return _prefill_fused(dec, ids, slot, k_caches, v_caches, all_logits, greedy)
    h, _ = _unfused_rows(dec, [(ids, slot)], k_caches, v_caches, last_only=not all_logits)
    logits = dec.norm_logits(h)
    return logits if all_logits else logits[0]


def prefill_many(
    dec: Decoder,
    prompts: list[tuple[torch.Tensor, int]],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Unfused path, several prompts at once: [(ids [T_i], slot_i)] -> last logits [V] of each.

    Per-token work (norms, projections, MLP, head) runs once over all prompts' rows stacked, so
    the matrix products are larger; attention and the cache writes run per prompt on its rows.
    The same computation as `prefill` for each prompt, up to the rounding of the larger products.
    """
    if dec.fused:
        raise ValueError("prefill_many serves the unfused path")
    h, _ = _unfused_rows(dec, prompts, k_caches, v_caches, last_only=True)
    return list(dec.norm_logits(h).unbind(0))


def _unfused_rows(
    dec: Decoder,
    prompts: list[tuple[torch.Tensor, int]],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    first: list[int] | None = None,
    last_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers over the prompts' rows stacked, each prompt at positions
    first_i..first_i+T_i-1 of its slot (first: 0 for each unless given; rows before first_i are
    already in the slot and are attended to from there): final hidden states [sum T_i, H] and
    the row index of each prompt's last token. last_only: the hidden states of each prompt's last
    row only ([P, H], indices 0..P-1), the last layer's o projection and MLP run on those rows."""
    if dec.family is not None:
        return dec.family.prefill_rows(prompts, k_caches, v_caches, first, last_only)
    c, w = dec.cfg, dec.w
    lens = [int(ids.shape[0]) for ids, _ in prompts]
    first = first or [0] * len(prompts)
    starts = [sum(lens[:j]) for j in range(len(lens))]
    ids = torch.cat([p[0] for p in prompts])
    cos = torch.cat([dec.cos[p0:p0 + t] for p0, t in zip(first, lens)])
    ssin = torch.cat([dec.ssin[p0:p0 + t] for p0, t in zip(first, lens)])
    real = ids.shape[0]
    n = cpu_prefill_rows(real) if dec.pads_prefill_rows else real
    if n > real:  # padding rows: token 0 at angle 0; row-wise work only, never written or returned
        ids, cos, ssin = F.pad(ids, (0, n - real)), F.pad(cos, (0, 0, 0, n - real)), F.pad(ssin, (0, 0, 0, n - real))
    h = quant_ops.embedding(ids, w.embed)
    last = torch.tensor([s0 + t - 1 for s0, t in zip(starts, lens)], device=h.device)
    for i, lw in enumerate(w.layers):
        x = rms_norm(h, lw.attn_norm, c.rms_eps)
        qkv = dec.project(x, i, "qkv")
        # q and k heads are adjacent in each qkv row: one rotation for both (apply_rope's bits)
        qk = apply_rope_rolled(qkv[:, : c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim),
                               cos, ssin)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]
        v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        gqa = c.num_heads != c.num_kv_heads
        a = write_and_attend(q, k, v, prompts, starts, lens, first, k_caches[i], v_caches[i],
                             lambda qr, kr, vr: _attend_after(qr, kr, vr, dec.scale, gqa))
        a = a.reshape(n, c.q_size)
        if last_only and i == len(w.layers) - 1:  # nothing reads the other rows' outputs of this layer
            h, a = h[last], a[last]
        h = h + dec.project(a, i, "o")
        x = rms_norm(h, lw.mlp_norm, c.rms_eps)
        g, u = dec.project(x, i, "gate_up").chunk(2, dim=-1)
        h = h + dec.project(F.silu(g) * u, i, "down")
    if last_only:  # the last layer kept those rows alone (a model without layers: taken here)
        return (h if w.layers else h[last]), torch.arange(len(lens), device=h.device)
    return h[:real], last


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: list, starts: list[int],
                     lens: list[int], first: list[int], k_cache: torch.Tensor, v_cache: torch.Tensor,
                     attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One layer of a plain prefill of several prompts packed as rows: prompt j's K/V rows written
    to its slot at positions first[j].., its queries attended by `attend(q, k, v)` over its own new
    rows (a fresh prompt) or over the slot's rows up to them (after cached rows). Returns the
    attention output [n, Hq, D]; rows past the prompts (padding) are 0."""
    a = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    a[starts[-1] + lens[-1]:] = 0
    for (_, slot), s0, t, p0 in zip(prompts, starts, lens, first):
        rows = slice(s0, s0 + t)
        k_cache[slot, p0:p0 + t] = k[rows]
        v_cache[slot, p0:p0 + t] = v[rows]
        a[rows] = attend(q[rows], k[rows] if p0 == 0 else k_cache[slot, :p0 + t],
                         v[rows] if p0 == 0 else v_cache[slot, :p0 + t])
    return a


def _attend_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """Rows q [t, Hq, D] at the last t of the n positions of k / v [n, Hkv, D]: row r attends to
    positions 0..n-t+r (causal, aligned to the end) -> [t, Hq, D]. With n == t, SDPA's own causal
    mask (no mask tensor); else flash attention's causal mode where it can run (it aligns the mask
    to the end, and takes grouped heads as they are), or a boolean mask."""
    t, n = q.shape[0], k.shape[0]
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n != t and _flash_runs(q4, k4, v4):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q4, k4, v4, 0.0, is_causal=True, return_debug_mask=False, scale=scale)[0]
        return out[0].transpose(0, 1)
    allowed = None
    if n != t:
        allowed = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - t, n, device=q.device)[:, None]
    return F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=allowed, is_causal=allowed is None, scale=scale, enable_gqa=gqa,
    )[0].transpose(0, 1)


def _flash_runs(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> bool:
    """torch's flash attention takes these [1, H, T, D] views as they are (CUDA, fp16/bf16, a head
    size it serves unpadded, its backend on): the call torch.nn.attention.bias's lower-right
    causal bias makes, whose module imports torch._dynamo (seconds) and is not imported here."""
    if (not q4.is_cuda or q4.dtype not in _FLASH_DTYPES or q4.shape[-1] % 8
            or not torch.backends.cuda.flash_sdp_enabled()):
        return False
    params = torch.backends.cuda.SDPAParams(q4, k4, v4, None, 0.0, False, q4.shape[1] != k4.shape[1])
    return torch.backends.cuda.can_use_flash_attention(params)


def prefill_after(
    dec: Decoder,
    ids: torch.Tensor,
    first: int,
    slot: int,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    greedy: bool = False,
) -> torch.Tensor:
    """The prompt tokens `ids` at positions first..first+T-1 of slot `slot`, whose rows [0, first)
    are already in the cache (engine.prefix_reuse); returns the last logits [V] (float32;
    greedy: see `head`)."""
    t = int(ids.shape[0])
    if first + t > k_caches[0].shape[1]:
        raise ValueError(f"positions {first}..{first + t - 1} do not fit the cache")
    if dec.fused:  # eager: the prefill graphs attend to fresh rows only
        _check_prompt(dec, first + t, slot, k_caches)
        dev = dec.device
        pos = torch.arange(first, first + t, dtype=torch.int64, device=dev)
        slots = torch.full((t,), slot, dtype=torch.int64, device=dev)
        last = torch.full((1,), t - 1, dtype=torch.int64, device=dev)
        h, delta = _fused_layers(dec, ids, pos, slots, None, k_caches, v_caches, after=(slot, first), keep=last)
        return final_logits(dec, h, delta, greedy)[0]
    h, _ = _unfused_rows(dec, [(ids, slot)], k_caches, v_caches, first=[first], last_only=True)
    return dec.norm_logits(h)[0]


def cpu_prefill_rows(n: int) -> int:
    """Rows a CPU prefill of n rows runs its matrix products over where they go through oneDNN
    (bf16 / fp16, and float32 with packed weights: Decoder.pads_prefill_rows): n up to 16, then
    multiples of 8 up to 128, then the next of a geometric series (ratio 2^(1/4), multiples of 16):
    45 sizes up to 2048. torch's oneDNN products keep memory for every row count they have seen,
    without bound (one [3072, 576] weight after 600 distinct counts: bf16 ~1.1 GB, packed float32
    ~2 GB); over bounded sizes the embedded model's 3-minute bf16 soak grows 42 MiB (float32 on
    MKL: 22; unbounded: 165). The padding adds at most 7 rows up to 128 and at most 25% above."""
    if n <= 16:
        return n
    if n <= 128:
        return cdiv(n, 8) * 8
    rows = 128
    while rows < n:
        rows = cdiv(int(rows * 2 ** 0.25), 16) * 16
    return rows


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] (any strides) -> the [1, H, T, D] view SDPA takes, in one op."""
    t, h, d = x.shape
    s0, s1, s2 = x.stride()
    return x.as_strided((1, h, t, d), (t * s0, s1, s0, s2))


def sdpa_causal(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of [1, Hq, T, D] over [1, Hkv, T, D] -> [T, Hq*D].

    bf16/fp16 pass the grouped heads to SDPA (enable_gqa); float32 GQA expands K/V heads first,
    since no fused backend takes grouped float32 heads and enable_gqa would run the math one.
    """
    _, hq, t, d = q4.shape
    a = _causal_sdpa(q4, k4, v4, scale)
    if a.stride() == (t * hq * d, d, hq * d, 1):  # [1, T, Hq, D] memory (flash, cuDNN): a view
        return a.as_strided((t, hq * d), (hq * d, 1))
    return a.transpose(1, 2).reshape(t, hq * d)


def _causal_sdpa(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA of [B, Hq, T, D] over [B, Hkv, T, D] -> [B, Hq, T, D], grouped heads as
    `sdpa_causal` says (bf16/fp16 as they are, float32 expanded first)."""
    b, hq, t, d = q4.shape
    hkv = k4.shape[1]
    gqa = hq != hkv
    if gqa and q4.dtype not in _FLASH_DTYPES:
        g = hq // hkv
        k4 = k4[:, :, None].expand(b, hkv, g, t, d).reshape(b, hq, t, d)
        v4 = v4[:, :, None].expand(b, hkv, g, t, d).reshape(b, hq, t, d)
        gqa = False
    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (any strides with a unit last stride) -> [T, Hq*D]."""
    return sdpa_causal(heads_first(q), heads_first(k), heads_first(v), scale)


# Token counts a fused prefill is padded to (the smallest bucket >= T that fits the cache). Padding
# is a function of T alone, so eager prefill and the captured prefill graphs (engine.modes.prefill_graphs)
# run the same shapes and kernels and give the same bits. Prompts longer than the last bucket run
# at their own length, eagerly.
PREFILL_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


# SDPA backends for the fused prefill's attention. torch's default picks cuDNN attention in
# bf16/fp16, which builds a plan the first time it sees a shape: ~40 ms on an H100, where flash
# runs a call at 2100 rows ~0.06 ms slower. Bucketed lengths are few
# shapes, each paid once (most at start-up), so they keep cuDNN; the rest (prompts past the last
# bucket, several prompts at their own lengths, a prefill after cached rows) would pay a plan at
# nearly every new prompt, so they run without it.
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(rows: int | None, device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends a fused prefill whose prompts attend over `rows` rows each (None: rows
    that vary or follow cached ones) runs its layers under: torch's default at a bucketed length
    or off CUDA, cuDNN attention excluded otherwise."""
    if device.type != "cuda" or rows in PREFILL_BUCKETS:
        return contextlib.nullcontext()
    return sdpa_kernel(_NO_CUDNN)


def bucket_for(t: int, max_context: int) -> int:
    """Padded length of a fused prefill of t tokens into a cache of max_context positions."""
    for b in PREFILL_BUCKETS:
        if t <= b <= max_context:
            return b
    return t


def _prefill_fused(
    dec: Decoder,
    ids: torch.Tensor,
    slot: int,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    all_logits: bool,
    greedy: bool = False,
) -> torch.Tensor:
    """The fused path. With all_logits, exactly T rows; otherwise the prompt padded to its bucket
    (rows >= T of the slot then hold padding K/V, which decode overwrites before reading)."""
    t = ids.shape[0]
    cache_len = k_caches[0].shape[1]
    _check_prompt(dec, t, slot, k_caches)
    dev = dec.device
    slot_dev = torch.full((1,), slot, dtype=torch.int64, device=dev)
    if all_logits:
        h, delta = prefill_rows(dec, ids, slot_dev, k_caches, v_caches)
        return final_logits(dec, h, delta)
    padded = torch.zeros(bucket_for(t, cache_len), dtype=torch.int64, device=dev)
    padded[:t] = ids
    last = torch.full((1,), t - 1, dtype=torch.int64, device=dev)
    return head(dec, prefill_last(dec, padded, slot_dev, last, k_caches, v_caches), greedy)[0]


def _check_prompt(dec: Decoder, t: int, slot: int, k_caches: list[torch.Tensor]) -> None:
    """The fused kernels write rows unchecked: a prompt of t tokens must fit the slot's rows and
    the RoPE tables, and the slot must exist (host ints, no sync)."""
    cache_len = k_caches[0].shape[1]
    if t > cache_len or t > dec.cos.shape[0]:
        raise ValueError(f"prompt of {t} tokens exceeds the context of {cache_len}")
    if not 0 <= slot < k_caches[0].shape[0]:
        raise ValueError(f"slot {slot} out of range")


def prefill_last(dec: Decoder, ids: torch.Tensor, slot_dev: torch.Tensor, last: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
    """The final-normed row `last` [1, H] (a device index) of a fused prefill of `ids` into cache
    slot `slot_dev` (a device int64 [1]), for `head`. Graph-capturable: no host values but shapes."""
    h, delta = prefill_rows(dec, ids, slot_dev, k_caches, v_caches, keep=last)
    return final_rows(dec, h, delta)


def prefill_rows(dec: Decoder, ids: torch.Tensor, slot_dev: torch.Tensor, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer add_rms_norm, qkv, rope_kv_write (K/V to the cache and RoPE'd k to a scratch),
    causal SDPA over the fresh k and v, wo, add_rms_norm, gate_up, silu_mul, down. Returns the
    residual h and the last MLP output `delta` not yet added to it, for every row (keep: for
    those device row indices only, see _fused_layers)."""
    t = ids.shape[0]
    pos = torch.arange(t, dtype=torch.int64, device=dec.device)
    return _fused_layers(dec, ids, pos, slot_dev.expand(t), None, k_caches, v_caches, keep=keep)


def prefill_many_fused(
    dec: Decoder,
    prompts: list[tuple[torch.Tensor, int]],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Fused path, several prompts in one pass: [(ids [T_i], slot_i)] -> last logits [V] of each
    (float32). The per-token kernels and projections run once over all prompts' rows stacked
    (one GEMM of sum T_i rows per weight instead of one per prompt); each prompt attends causally
    to its own rows only (PaddedPrompts: one batched SDPA, or per prompt when padding would cost
    too much). Eager only (the row count varies); projections see no padding."""
    for ids, slot in prompts:
        _check_prompt(dec, ids.shape[0], slot, k_caches)
    lens = [int(ids.shape[0]) for ids, _ in prompts]
    starts = [sum(lens[:j]) for j in range(len(lens))]
    dev = dec.device
    # positions, slots and last rows built on the host, one copy each
    pos = torch.cat([torch.arange(t, dtype=torch.int64) for t in lens]).to(dev, non_blocking=True)
    slots = torch.cat([torch.full((t,), s, dtype=torch.int64) for t, (_, s) in zip(lens, prompts)])
    last = torch.tensor([s0 + t - 1 for s0, t in zip(starts, lens)], dtype=torch.int64)
    ids = torch.cat([p[0].to(dev) for p in prompts])
    h, delta = _fused_layers(dec, ids, pos, slots.to(dev, non_blocking=True), list(zip(starts, lens)),
                             k_caches, v_caches, keep=last.to(dev, non_blocking=True))
    return list(final_logits(dec, h, delta).unbind(0))


# Several prompts prefilled as one batch of equal padded length tb = bucket_for(longest) (the
# route the batch prefill graphs capture): used when tb <= BATCH_MAX_T and the padded rows are few
# (b * tb <= BATCH_SMALL_ROWS) or waste at most BATCH_ROW_WASTE x the real ones. The route is a
# function of the prompt lengths alone, so eager and graph replay run the same shapes and bits.
BATCH_MAX_T = 512
BATCH_SMALL_ROWS = 1024
BATCH_ROW_WASTE = 2.0


def batch_bucket(lens: list[int], cache_len: int) -> int | None:
    """The padded length of the batch route for prompts of `lens` tokens, or None where it does
    not apply (one prompt, long prompts, too much padding)."""
    if len(lens) < 2 or min(lens) < 1:
        return None
    tb = bucket_for(max(lens), cache_len)
    if tb not in PREFILL_BUCKETS or tb > BATCH_MAX_T:
        return None
    rows = len(lens) * tb
    return tb if rows <= BATCH_SMALL_ROWS or rows <= BATCH_ROW_WASTE * sum(lens) else None


def prefill_batch_last(dec: Decoder, ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                       k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
    """The final-normed rows [B, H] (for `head`) of rows `last` (device [B], prompt j's last row j * tb + T_j - 1)
    of B prompts right-padded to tb tokens each, ids [B * tb], prefilled into cache slots `slots`
    (device int64 [B]). Pad rows write K/V at positions [T_j, tb) of their slot, which decode
    overwrites before reading. Graph-capturable: no host values but shapes."""
    b = slots.shape[0]
    tb = ids.shape[0] // b
    pos = torch.arange(tb, dtype=torch.int64, device=dec.device).repeat(b)
    row_slots = slots[:, None].expand(b, tb).reshape(b * tb)
    h, delta = _fused_layers(dec, ids, pos, row_slots, None, k_caches, v_caches, batch=b, keep=last)
    return final_rows(dec, h, delta)


def pack_batch(prompts: list[tuple[torch.Tensor, int]], tb: int, ids: torch.Tensor, slots: torch.Tensor,
               last: torch.Tensor) -> None:
    """Write the prompts [(ids [T_j], slot_j)] into the batch route's device inputs: the first
    B * tb entries of ids (prompt j at rows j * tb + [0, T_j), zeros after it), and the first B
    of slots and of last (prompt j's last row)."""
    b = len(prompts)
    ids[:b * tb].zero_()
    rows = ids[:b * tb].view(b, tb)
    for j, (p, _) in enumerate(prompts):
        rows[j, :p.shape[0]].copy_(p)
    lens = [int(p.shape[0]) for p, _ in prompts]
    host = torch.tensor([[s for _, s in prompts], [j * tb + t - 1 for j, t in enumerate(lens)]],
                        dtype=torch.int64)
    slots[:b].copy_(host[0], non_blocking=True)
    last[:b].copy_(host[1], non_blocking=True)


def prefill_batch(dec: Decoder, prompts: list[tuple[torch.Tensor, int]], tb: int,
                  k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The batch route run eagerly: [(ids [T_j], slot_j)] -> last logits [V] of each (float32)."""
    for p, slot in prompts:
        _check_prompt(dec, p.shape[0], slot, k_caches)
    b, dev = len(prompts), dec.device
    ids = torch.empty(b * tb, dtype=torch.int64, device=dev)
    slots = torch.empty(b, dtype=torch.int64, device=dev)
    last = torch.empty(b, dtype=torch.int64, device=dev)
    pack_batch(prompts, tb, ids, slots, last)
    return list(head(dec, prefill_batch_last(dec, ids, slots, last, k_caches, v_caches)).unbind(0))


def _batched_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, scale: float) -> torch.Tensor:
    """Causal attention of b equal-length prompts stacked as rows: q [n, Hq, D], k/v [n, Hkv, D]
    (any row strides, unit last stride) -> [n, Hq*D]. Right padding is exact under the causal
    mask: a prompt's real rows see only earlier rows of the same prompt."""
    n, hq, d = q.shape
    t = n // b
    q4, k4, v4 = (x.view(b, t, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    return _causal_sdpa(q4, k4, v4, scale).transpose(1, 2).reshape(n, hq * d)


def _fused_layers(dec: Decoder, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                  spans: list[tuple[int, int]] | None, k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor], batch: int = 1,
                  after: tuple[int, int] | None = None,
                  keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers over rows `ids` at positions `pos` of cache slots `slots` (per row).
    spans None: the rows are `batch` prompts of n / batch rows each (right-padded), each attending
    causally to its own rows; else [(first row, length)] per prompt, each attending causally to
    its own rows only. after=(slot, first): the rows are one prompt's positions first.. of that
    slot, attending to the slot's cached rows [0, first) and causally to their own.
    keep (device row indices): the only rows whose outputs are returned, in keep's order; the last
    layer runs its o projection and MLP on those rows alone (its K/V are written for every row
    before, and no other row's output of that layer is read by anything)."""
    from fgchat.engine.kernels import fused as fk
    from fgchat.engine.kernels import qgemv  # dense weights: F.linear / F.embedding as they are
    from fgchat.engine.model.family_stages import windowed_attention

    c, w = dec.cfg, dec.w
    stages = dec.fused_stages
    assert stages is not None, "the fused layers need the fused decoder"
    n = ids.shape[0]
    dev = dec.device
    h = qgemv.embedding(ids, w.embed)
    delta: torch.Tensor | None = None
    v_at = c.q_size + c.kv_size
    padded = PaddedPrompts.build(spans, c.num_heads, c.num_kv_heads, c.head_dim, h.dtype, dev)
    if padded is not None:
        rows = padded.tmax
    elif spans is None and after is None:
        rows = n // batch
    else:
        rows = None  # prompts at their own lengths, or rows after cached ones
    last_layer = len(w.layers) - 1
    table_rows = stages.prefill_table_rows(pos, spans, batch, after, keep)  # LongRoPE: long rows past the cut
    with attention_backends(rows, dev):
        for i, lw in enumerate(w.layers):
            h, x = stages.layer_input(i, h, delta)
            qkv = qgemv.linear(x, lw.wqkv, lw.bqkv)
            k = torch.empty((n, c.num_kv_heads, c.head_dim), dtype=qkv.dtype, device=dev)
            q = stages.rope_kv_write(i, qkv, pos, slots, k_caches[i], v_caches[i], k_out=k, table_rows=table_rows)
            v = qkv[:, v_at:].view(n, c.num_kv_heads, c.head_dim)  # a strided view: no copy
            window = dec.layer_windows[i] if dec.layer_windows else 0
            if window and (after[1] if after else 0) + (rows or n) > window:  # rows that see past it
                a = windowed_attention(q, k, v, dec, i, window, spans, batch, after, k_caches, v_caches)
            elif after is not None:
                slot, first = after
                a = _attend_after(q, k_caches[i][slot, :first + n], v_caches[i][slot, :first + n], dec.scale,
                                  c.num_heads != c.num_kv_heads).reshape(n, c.q_size)
            elif spans is None and batch > 1:
                a = _batched_sdpa(q, k, v, batch, dec.scale)
            elif spans is None:
                a = sdpa_causal(heads_first(q), heads_first(k), heads_first(v), dec.scale)
            elif padded is not None:
                a = padded.attention(q, k, v, dec.scale)
            else:
                a = torch.empty((n, c.q_size), dtype=qkv.dtype, device=dev)
                for s0, t in spans:
                    r = slice(s0, s0 + t)
                    a[r] = sdpa_causal(heads_first(q[r]), heads_first(k[r]), heads_first(v[r]), dec.scale)
            if keep is not None and i == last_layer:
                h, a = h.index_select(0, keep), a.index_select(0, keep)
            h, x = stages.norm(h, qgemv.linear(a, lw.wo), stages.mlp_norms[i], post=stages.post_attn[i])
            delta = qgemv.linear(fk.silu_mul(qgemv.linear(x, lw.w_gate_up), gelu=stages.gelu), lw.w_down)
    return h, delta


# Several prompts' attention runs as one batched SDPA over right-padded prompts when the padding
# wastes little (B * Tmax^2 <= PAD_WASTE_LIMIT * sum T^2) or the prompts are short (Tmax <=
# PAD_SHORT_TMAX, where attention is cheap and per-prompt launches dominate); else once per prompt.
PAD_WASTE_LIMIT = 2.0
PAD_SHORT_TMAX = 256


class PaddedPrompts:
    """The round's prompts as a [B, Tmax] batch for one causal SDPA.

    Prompt j's rows sit at padded rows j * Tmax + [0, T_j). Right padding is exact under the causal
    mask: a real row attends only to earlier rows of its own prompt, all real. The pad rows of the
    q/k/v buffers are zeroed once and never written (stale values there could be NaN, and 0 * NaN
    is NaN even where the softmax weight is 0); their outputs are never read."""

    def __init__(self, rows: torch.Tensor, b: int, tmax: int, hq: int, hkv: int, d: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.b, self.tmax = rows, b, tmax
        self.q = torch.zeros((b * tmax, hq, d), dtype=dtype, device=device)
        self.k = torch.zeros((b * tmax, hkv, d), dtype=dtype, device=device)
        self.v = torch.zeros((b * tmax, hkv, d), dtype=dtype, device=device)

    @classmethod
    def build(cls, spans: list[tuple[int, int]] | None, hq: int, hkv: int, d: int, dtype: torch.dtype,
              device: torch.device) -> PaddedPrompts | None:
        """None for one prompt, or when padding would waste too much attention work."""
        if not spans or len(spans) < 2:
            return None
        lens = [t for _, t in spans]
        tmax = max(lens)
        if tmax > PAD_SHORT_TMAX and len(lens) * tmax * tmax > PAD_WASTE_LIMIT * sum(t * t for t in lens):
            return None
        rows = torch.cat([torch.arange(t, dtype=torch.int64) + j * tmax for j, t in enumerate(lens)])
        return cls(rows.to(device, non_blocking=True), len(lens), tmax, hq, hkv, d, dtype, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [n, Hq, D], k/v [n, Hkv, D] (the prompts' rows stacked) -> [n, Hq*D]."""
        self.q.index_copy_(0, self.rows, q)
        self.k.index_copy_(0, self.rows, k)
        self.v.index_copy_(0, self.rows, v)
        return _batched_sdpa(self.q, self.k, self.v, self.b, scale).index_select(0, self.rows)


def final_rows(dec: Decoder, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """The final norm of residual rows h (+ delta): what the LM head reads."""
    stages = dec.fused_stages
    assert stages is not None, "the fused rows need the fused decoder"
    return stages.final_rows(h, delta)[1]


def head(dec: Decoder, x: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """Float32 logits [N, V] of final-normed rows x: on CUDA the decode head's route and tile
    (float32 sums). greedy: rows whose only use is their argmax; where the int8 pick serves N
    rows the logits come from it: the argmax is the exact head's, other logits approximate."""
    stages = dec.fused_stages
    picked = stages.pick_logits(x) if greedy and stages is not None else None
    if picked is not None:
        return picked
    if stages is not None and x.is_cuda:
        return stages.logits(x)
    return dec.head_logits(x)


def final_logits(dec: Decoder, h: torch.Tensor, delta: torch.Tensor | None, greedy: bool = False) -> torch.Tensor:
    return head(dec, final_rows(dec, h, delta), greedy)
