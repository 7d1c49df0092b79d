"""On-device sampling: greedy, temperature, top-k, top-p. No host syncs, graph-capturable.

Randomness is a counter-based hash of (request seed, token position, vocabulary id), never a global
generator state: the same request samples the same text in every mode and batch composition.
"""

from __future__ import annotations

import torch

_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as signed int64
_M2 = -7723592293110705685  # 0x94D049BB133111EB as signed int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as signed int64


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser; int64 multiplication wraps modulo 2^64."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) determined only by (seed, position, vocabulary id)."""
    row = _mix64(seeds * _GOLDEN + _mix64(positions))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix64(row[:, None] + cols[None, :] * _GOLDEN)
    return (_shr(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim (first index of the maximum), in two reductions.

    One row of a large vocabulary is a single-block reduction for torch.argmax (36 us for 128K
    logits on an H200); splitting the row into chunks spreads the first pass over many blocks.
    The first maximum of the first chunk holding the row maximum is the row's first maximum.
    """
    b, v = logits.shape
    chunks = 256
    while chunks > 1 and v % chunks:
        chunks //= 2
    if chunks < 16 or v // chunks < 64:
        return torch.argmax(logits, dim=-1)
    width = v // chunks
    vals, idx = logits.view(b, chunks, width).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return (idx.gather(1, best) + best * width)[:, 0]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    filtered: bool = True,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Per-row sampling of logits [B, V] (float32). Rows with temperature <= 0 are greedy.

    top_k <= 0 disables top-k; top_p >= 1 disables top-p. The top token always survives filtering.
    The token is the Gumbel-max pick: argmax over the kept tokens of logit / T + Gumbel noise of
    (seed, position, token id). filtered=False (no row has top-k or top-p on) skips the sort that
    filtering needs; a row without filtering picks the same token either way (exact ties of
    logit / T + noise go to the smallest id on both paths). Unfiltered, on CUDA
    (use_triton None) or where use_triton says, the pick runs as two Triton kernels
    (sampling_triton.pick: the same arithmetic, one pass over the logits).
    """
    if not filtered and (logits.is_cuda if use_triton is None else use_triton):
        from fgchat.engine.kernels import sampling_triton

        return sampling_triton.pick(logits.float().contiguous(), temperature, seeds, positions)
    b, v = logits.shape
    is_greedy = temperature <= 0
    t = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    u = uniform_noise(seeds, positions, v)
    if not filtered:
        sampled = torch.argmax(scaled + -torch.log(-torch.log(u)), dim=-1)
        return torch.where(is_greedy, greedy(logits), sampled)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    _, drop = dropped_ranks(sorted_logits, top_p, top_k)
    filtered_logits = sorted_logits.masked_fill(drop, float("-inf"))
    score = filtered_logits - torch.log(-torch.log(u.gather(1, order)))
    # the smallest id among exact ties of the score, as the unfiltered argmax picks: the sort's
    # order among equal logits is unspecified, and a token must not depend on it
    best = score.amax(dim=-1, keepdim=True)
    sampled = torch.where(score == best, order, v).amin(dim=-1)
    return torch.where(is_greedy, greedy(logits), sampled)


def dropped_ranks(sorted_logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits / T sorted descending [B, V]: their softmax, and which ranks top-k and top-p
    drop (never rank 0)."""
    v = sorted_logits.shape[-1]
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each rank
    rank = torch.arange(v, device=sorted_logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    # top-p 1 drops nothing (a cumsum may round past 1.0 in the tail)
    drop = ((before > top_p[:, None]) & (top_p[:, None] < 1.0)) | (rank >= k[:, None])
    drop[:, 0] = False
    return probs, drop


def needs_filter(top_p: float, top_k: int, vocab: int) -> bool:
    """Whether a sampled request's top-p / top-k drop anything (the filtered step variant)."""
    return top_p < 1.0 or 0 < top_k < vocab
