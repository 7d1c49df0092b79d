"""Which drafts the target accepts, and the token it adds.

Greedy: accept while the draft is the target's argmax, then the target's argmax. Sampled:
speculative rejection sampling — draft d_j drawn from the proposer's q_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from
norm(max(0, p_j - q_j)), and when every draft is accepted from p_k. The emitted tokens then follow
the target's p exactly. A proposer without a distribution (ngram, oracle) is a point mass q.

Randomness is counter-based, as plain sampling's (kernels.sampling): the uniforms of a row are a
hash of (request seed, position, stream), so seeded runs are reproducible in any batch."""

from __future__ import annotations

import torch

from fgchat.engine.kernels.sampling import dropped_ranks, uniform_noise

# streams derived from a request's seed: the target's own sampling uses the seed itself
STREAM_ACCEPT = 0x5EC0_0001
STREAM_RESIDUAL = 0x5EC0_0002
STREAM_DRAFT = 0x5EC0_0003


def stream_seeds(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    """Seeds of an independent stream (another counter-hash input) from request seeds."""
    return seeds ^ stream


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor) -> torch.Tensor:
    """The distribution plain sampling draws from, per row of logits [N, V]: softmax(logits / T)
    over the tokens top-k and top-p keep (the top token always kept), renormalized; a row with
    temperature <= 0 is the one-hot of its argmax."""
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    sorted_logits, order = torch.sort(logits / t[:, None], dim=-1, descending=True)
    probs, drop = dropped_ranks(sorted_logits, top_p, top_k)
    kept = probs.masked_fill(drop, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(kept).scatter_(1, order, kept)
    onehot = torch.zeros_like(out).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, out)


def gumbel_pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A draw from each row of probs [N, V] (need not be normalized) with uniforms [N, V] in (0, 1):
    argmax of log p + Gumbel noise (zero-probability tokens are never drawn)."""
    return torch.argmax(torch.log(probs) - torch.log(-torch.log(uniforms)), dim=-1)


def accept(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, u: torch.Tensor,
           residual_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling for N sequences of k drafts each.

    p [N, k + 1, V]: the target's distributions at the k + 1 verified positions; q [N, k, V]: the
    proposer's at the k drafted ones (None: a point mass on each draft); drafts [N, k]; u [N, k]
    uniforms for the accept tests; residual_u [N, k + 1, V] uniforms for the added token.
    Returns (accepted [N]: drafts accepted, a prefix; token [N]: the token after them)."""
    n, k1, v = p.shape
    k = k1 - 1
    rows = torch.arange(n, device=p.device)
    if k:
        idx = drafts[..., None]
        p_d = p[:, :k].gather(2, idx)[..., 0]
        q_d = torch.ones_like(p_d) if q is None else q.gather(2, idx)[..., 0]
        ok = u < torch.clamp(p_d / q_d, max=1.0)
        accepted = torch.cumprod(ok.int(), dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(n, dtype=torch.int64, device=p.device)
    p_m = p[rows, accepted]
    if k:
        if q is None:
            q_full = torch.zeros(n, k, v, dtype=p.dtype, device=p.device).scatter_(2, drafts[..., None], 1.0)
        else:
            q_full = q
        q_m = torch.cat([q_full, torch.zeros_like(p[:, :1])], dim=1)[rows, accepted]  # 0 after the last draft
        residual = torch.clamp(p_m - q_m, min=0.0)
        # a residual of no mass only where p == q at a rejected row, which the test accepts surely
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_m, residual)
    else:
        residual = p_m
    token = gumbel_pick(residual, residual_u[rows, accepted])
    return accepted, token


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """Greedy acceptance for one sequence: logits [k + 1, V] at the verified positions; the
    drafts accepted (a prefix: each equal to the target's argmax) and the target's token after
    them."""
    from fgchat.engine.kernels.sampling import greedy

    return greedy_prefix(greedy(logits.float()).tolist(), drafts)


def greedy_prefix(best: list[int], drafts: list[int]) -> tuple[int, int]:
    """Greedy acceptance from the target's picks `best` at the k + 1 verified positions: the
    drafts accepted (the prefix equal to the picks) and the pick after them."""
    m = 0
    while m < len(drafts) and drafts[m] == best[m]:
        m += 1
    return m, best[m]


def row_uniforms(seed: int, positions: list[int], stream: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Uniforms [len(positions), vocab] of a request's stream at these positions."""
    seeds = torch.full((len(positions),), int(seed), dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return uniform_noise(stream_seeds(seeds, stream), pos, vocab)
