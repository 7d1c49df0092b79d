"""Speculative rejection sampling keeps the target's distribution (engine.speculate.accept):
20,000 direct draws on fixed p and q distributions, and a shorter end-to-end run of the tiny
model against plain sampling, compared by chi-square (p > 0.001)."""

from __future__ import annotations

import torch

from fgchat.engine.core import Engine
from fgchat.engine.kernels.sampling import uniform_noise
from fgchat.engine.speculate.accept import accept, target_probs
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.events import RequestFinished, SamplingParams

DRAWS = 20_000


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """The goodness-of-fit p-value of counts `observed` against `expected` counts; 0 when a cell
    of expected count 0 is not empty (a token of probability 0 was drawn)."""
    keep = expected > 0
    if observed[~keep].sum() > 0:
        return 0.0
    o, e = observed[keep].double(), expected[keep].double()
    stat = ((o - e) ** 2 / e).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def two_sample_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that counts a and b (same total) come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    stat = ((a - b) ** 2 / (a + b)).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def uniforms(n: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """[n, *shape] uniforms of the engine's counter hash (seed, row)."""
    width = int(torch.tensor(shape).prod())
    u = uniform_noise(torch.full((n,), seed, dtype=torch.int64), torch.arange(n), width)
    return u.view(n, *shape)


def fixed_distributions(v: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, dim=-1)
    p[0, 3] = 0.0  # a token the target never emits that the draft proposes
    p = p / p.sum(dim=-1, keepdim=True)
    return p, q


def draws(p: torch.Tensor, q: torch.Tensor | None, point: torch.Tensor | None = None) -> torch.Tensor:
    """The first emitted token of DRAWS speculative steps: the first draft if accepted, else the
    token drawn after the rejection."""
    k1, v = p.shape
    k = k1 - 1
    if q is not None:  # drafts drawn from q by inverse CDF on independent uniforms
        cdf = torch.cumsum(q, dim=-1)
        cdf[:, -1] = 1.0  # a float32 cumsum may end just short of 1
        dq = uniforms(DRAWS, (k,), 101)
        drafts = torch.searchsorted(cdf.expand(DRAWS, k, v).contiguous(), dq[..., None])[..., 0].clamp(max=v - 1)
    else:
        drafts = point.expand(DRAWS, k)
    m, tok = accept(p.expand(DRAWS, k1, v), None if q is None else q.expand(DRAWS, k, v), drafts,
                    uniforms(DRAWS, (k,), 202), uniforms(DRAWS, (k1, v), 303))
    first = torch.where(m > 0, drafts[:, 0], tok)
    return first, m, tok, drafts


def test_rejection_sampling_keeps_the_target_distribution_with_a_draft_distribution():
    p, q = fixed_distributions(v=12, k=3, seed=0)
    first, m, tok, drafts = draws(p, q)
    pv = chi_square_p(torch.bincount(first, minlength=12), p[0] * DRAWS)
    assert pv > 1e-3, f"first token against p: chi-square p-value {pv:.2e}"
    # the token after every accepted draft follows the target's last distribution
    full = m == 3
    assert full.sum() > 500
    pv = chi_square_p(torch.bincount(tok[full], minlength=12), p[3] * full.sum())
    assert pv > 1e-3, f"the bonus token against p_k: chi-square p-value {pv:.2e}"
    # acceptance of the first draft happens with probability sum(min(p, q))
    rate = float((m > 0).float().mean())
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 0.015
    print(f"acceptance {rate:.3f}, p-values ok")


def test_rejection_sampling_with_a_point_mass_draft():
    """ngram / oracle: q is a point mass on the draft; accepted with probability p(draft), else
    drawn from p without it."""
    p, _ = fixed_distributions(v=10, k=2, seed=1)
    for d in (int(p[0].argmax()), int(p[0].argmin()), 3):
        first, m, _, _ = draws(p, None, torch.tensor([d, 0]))
        pv = chi_square_p(torch.bincount(first, minlength=10), p[0] * DRAWS)
        assert pv > 1e-3, f"draft {d}: chi-square p-value {pv:.2e}"


def test_a_biased_acceptance_would_be_caught():
    """The test's own power: accepting every draft gives the draft's distribution, which the
    chi-square rejects."""
    p, q = fixed_distributions(v=12, k=1, seed=0)
    cdf = torch.cumsum(q[0], dim=-1)
    cdf[-1] = 1.0
    drafts = torch.searchsorted(cdf, uniforms(DRAWS, (1,), 101)[:, 0].contiguous()).clamp(max=11)
    assert chi_square_p(torch.bincount(drafts, minlength=12), p[0] * DRAWS) < 1e-3


def test_target_probs_is_plain_samplings_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    t = torch.tensor([0.7, 1.0, 0.0])
    probs = target_probs(logits, t, torch.tensor([0.9, 1.0, 1.0]), torch.tensor([0, 5, 0]))
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs[1] > 0).sum() == 5 and probs[2].max() == 1.0 and probs[2].argmax() == logits[2].argmax()
    full = torch.softmax(logits[0] / 0.7, -1)
    kept = probs[0] > 0
    assert full[kept].sum() >= 0.9 and full[kept].sum() - full[kept].min() < 0.9  # the smallest nucleus
    torch.testing.assert_close(probs[0][kept], full[kept] / full[kept].sum())


def test_end_to_end_speculative_sampling_matches_plain_sampling():
    """The tiny model sampled at top-k 4, 240 seeds drafted by another model of the same shape
    against 240 other seeds sampled plainly: the first decode token (with prefill's before it)
    and the second, compared by a two-sample chi-square."""
    def outputs(**kw) -> list[list[int]]:
        eng = Engine(EngineConfig(preset="tiny", device="cpu", seed=3, **kw))
        prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
        out = []
        for batch in range(30):
            for j in range(8):
                eng.submit(prompt, SamplingParams(temperature=1.0, top_k=4, seed=batch * 8 + j + (0 if kw else 1000),
                                                  max_tokens=3, ignore_eos=True))
            out += [ev.summary.token_ids for ev in eng.run_until_done() if isinstance(ev, RequestFinished)]
        return out

    spec = outputs(speculate="draft", draft="preset:tiny", draft_len=2)
    plain = outputs()
    assert len(spec) == len(plain) == 240
    for key in (lambda ids: (ids[0], ids[1]), lambda ids: ids[2]):
        cells = sorted({key(ids) for ids in spec + plain})
        a = torch.tensor([sum(key(ids) == c for ids in spec) for c in cells])
        b = torch.tensor([sum(key(ids) == c for ids in plain) for c in cells])
        pv = two_sample_p(a, b)
        assert pv > 1e-3, f"speculative against plain sampling: p-value {pv:.2e}"
