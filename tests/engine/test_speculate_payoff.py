"""Speculation that pays for itself (engine.speculate.payoff): the engine times plain and
speculative steps per (mode, batch size) and pauses speculation where its tokens cost more than
plain decoding's, re-probing after pauses that double while the probes lose.

The engine tests inject the engine's clock and advance it only inside the decode steps' model
runs, by a cost the test chooses per (batch size, rows per sequence): no timing flakiness, and the
expected pattern of plain and speculative steps follows from that cost alone. Greedy output is
compared against a plain engine of the same configuration."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine
from fgchat.engine.speculate import payoff
from fgchat.engine.speculate.payoff import FIRST_PAUSE, LONGEST_PAUSE, PAUSED, SPECULATE, SpecPayoff
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.events import RequestFinished, SamplingParams, TokenEvent

K = 4


def engine(**kw) -> Engine:
    return Engine(EngineConfig(preset="tiny", device="cpu", seed=3, max_context=256, **kw))


class FakeCost:
    """The engine's clock, in seconds, moved only by decode steps' model runs: `cost(b, block)` ms
    for a step of b sequences of `block` rows each (1: a plain step, k + 1: a verification)."""

    def __init__(self, eng: Engine, cost) -> None:
        self.t, self.cost, self.verifications = 0.0, cost, 0
        inner = eng.modes.run

        def run(mode, b, variant, block=1):
            self.verifications += block > 1
            self.t += self.cost(b, block) / 1e3
            return inner(mode, b, variant, block)

        eng.modes.run = run
        eng.clock = lambda: self.t


def run(eng: Engine, prompts: list[list[int]], params: SamplingParams):
    rids = [eng.submit(p, params) for p in prompts]
    evs = eng.run_until_done()
    done = {e.summary.request_id: e.summary for e in evs if isinstance(e, RequestFinished)}
    return [done[r] for r in rids], [e for e in evs if isinstance(e, TokenEvent)], rids


def step_kinds(evs: list[TokenEvent], rid: int) -> str:
    """One letter per decode step of a request: S speculative (drafts verified), p plain."""
    steps: dict[int, bool] = {}
    for e in evs:
        if e.request_id == rid and e.step_id >= 0:
            steps[e.step_id] = steps.get(e.step_id, False) or e.draft_len > 0
    return "".join("S" if steps[i] else "p" for i in sorted(steps))


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the estimator alone ----

def test_a_losing_shape_pauses_with_doubling_pauses_and_a_win_resets_them():
    p = SpecPayoff()
    for _ in range(payoff.PLAIN_WARMUP):
        p.plain_step("eager", 2, 10.0)
    assert p.verdict("eager", 2) == SPECULATE
    pauses = []
    for _ in range(7):
        for _ in range(payoff.SPEC_SAMPLES):  # a probe: 3 tokens per sequence at 40 ms > 10 ms a token
            assert p.verdict("eager", 2) == SPECULATE
            p.spec_step("eager", 2, 40.0, 3.0)
        n = 0
        while p.verdict("eager", 2) == PAUSED:  # ends on the probe's first SPECULATE
            n += 1
        pauses.append(n)
    assert pauses == [min(FIRST_PAUSE * 2 ** i, LONGEST_PAUSE) for i in range(7)]
    assert p.shapes[("eager", 2)].pauses == 7
    assert p.verdict("eager", 1) == SPECULATE  # another batch size: its own estimate
    for _ in range(payoff.SPEC_SAMPLES):  # a winning probe: 25 ms for 3 tokens < 10 ms a token
        p.spec_step("eager", 2, 25.0, 3.0)
    assert p.verdict("eager", 2) == SPECULATE and p.shapes[("eager", 2)].pause == FIRST_PAUSE


def test_a_new_shape_speculates_first_then_measures_plain_then_judges():
    p = SpecPayoff()
    verdicts = []
    for step in range(12):
        v = p.verdict("full", 8)
        verdicts.append(v[0])
        if v == SPECULATE:
            p.spec_step("full", 8, 50.0, 2.0)  # 25 ms a token
        else:
            p.plain_step("full", 8, 1000.0 if step == 2 else 10.0)  # the first plain step is warm-up: not counted
    assert "".join(verdicts) == "ss" + "m" * payoff.PLAIN_WARMUP + "p" * 7
    assert p.shapes[("full", 8)].plain.value == 10.0
    p.reset_speculation()  # another method: speculation measured afresh, plain kept
    assert p.verdict("full", 8) == SPECULATE and p.shapes[("full", 8)].plain.value == 10.0


def test_within_the_margin_speculation_stays_on():
    p = SpecPayoff()
    for _ in range(payoff.PLAIN_WARMUP):
        p.plain_step("eager", 1, 10.0)
    for _ in range(20):
        assert p.verdict("eager", 1) == SPECULATE
        p.spec_step("eager", 1, 10.0 * (1 + payoff.MARGIN / 2), 1.0)
    p.spec_step("eager", 1, 10.0 * (1 + 10 * payoff.MARGIN), 1.0)  # the running mean crosses the margin
    assert p.verdict("eager", 1) == PAUSED


# ---- the engine, on an injected clock ----

PROMPTS = [random_prompt(10, 1), random_prompt(14, 2), random_prompt(18, 3)]
OUT = 60


@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    got, _, _ = run(engine(), PROMPTS, SamplingParams(max_tokens=OUT, ignore_eos=True))
    return [s.token_ids for s in got]


def all_but_the_last_right(eng: Engine, outputs: list[list[int]]) -> None:
    """The engine's proposer replaced: k drafts per lane, the first k - 1 the plain run's own
    tokens and the last wrong, so each step accepts k - 1 and emits k tokens (k stays put)."""
    ref = {tuple(p): out for p, out in zip(PROMPTS, outputs)}

    def propose(seqs, ks):
        drafts = []
        for s, k in zip(seqs, ks):
            n, want = len(s.output_ids), ref[tuple(s.prompt_ids)]
            drafts.append(want[n:n + k - 1] + [(want[n + k - 1] + 1) % 512] if k and n + k <= len(want) else [])
        return drafts, [None] * len(seqs)

    eng._propose = propose


def test_verification_costing_k_plus_1_plain_steps_pauses_speculation(plain_outputs):
    """Compute-bound: a verification step costs k + 1 plain steps (every row alike) and emits k
    tokens a lane (1.25 plain steps a token at k = 4): speculation pauses after its first verdict,
    and the probe after the pause loses again."""
    eng = engine(speculate="ngram", draft_len=K)
    FakeCost(eng, lambda b, block: float(block))
    all_but_the_last_right(eng, plain_outputs)
    got, evs, rids = run(eng, PROMPTS, SamplingParams(max_tokens=OUT, ignore_eos=True))
    assert [s.token_ids for s in got] == plain_outputs
    kinds = step_kinds(evs, rids[0])
    print(f"lane 0 steps: {kinds}; spec {got[0].spec}")
    probe, warm = "S" * payoff.SPEC_SAMPLES, payoff.PLAIN_WARMUP
    # speculation measured (K tokens a step), plain measured, paused; a probe, a pause twice as long
    rest = OUT - 1 - 2 * len(probe) * K - warm - FIRST_PAUSE
    assert kinds == probe + "p" * (warm + FIRST_PAUSE) + probe + "p" * rest and rest < 2 * FIRST_PAUSE
    assert all(s.spec["paused_for_cost"] == FIRST_PAUSE + rest for s in got)
    assert all(s.spec["acceptance_rate"] == (K - 1) / K for s in got)
    assert eng.spec_payoff.shapes[("eager", len(PROMPTS))].pauses == 2


def test_verification_as_cheap_as_a_plain_step_keeps_speculating(plain_outputs):
    """Memory-bound: a verification step costs what a plain step does; the same drafts win."""
    eng = engine(speculate="ngram", draft_len=K)
    FakeCost(eng, lambda b, block: 1.0)
    all_but_the_last_right(eng, plain_outputs)
    got, evs, rids = run(eng, PROMPTS, SamplingParams(max_tokens=OUT, ignore_eos=True))
    assert [s.token_ids for s in got] == plain_outputs
    kinds = step_kinds(evs, rids[0])
    print(f"lane 0 steps: {kinds}; spec {got[0].spec}")
    shape = eng.spec_payoff.shapes[("eager", len(PROMPTS))]
    assert shape.plain.n > 0 and shape.spec.n > 0  # both sides measured and compared
    assert shape.pauses == 0 and all(s.spec["paused_for_cost"] == 0 for s in got)
    # speculated, plain measured once, speculated to the end (the last steps have no room for K)
    head = "S" * payoff.SPEC_SAMPLES + "p" * payoff.PLAIN_WARMUP
    assert kinds.startswith(head + "S") and kinds[len(head):].count("p") <= 1


def test_a_probe_after_a_pause_that_wins_turns_speculation_back_on():
    """Drafts that all hold (the plain run's own tokens: k + 1 tokens a step); the first
    verifications cost 1.5x their tokens' plain steps, later ones half: one pause, then
    speculation for good. (The oracle itself is never paused: the proposer stands in for it.)"""
    prompt = random_prompt(12, 5)
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    want, _, _ = run(engine(), [prompt], params)
    eng = engine(speculate="ngram", draft_len=K)
    cost = FakeCost(eng, lambda b, block: 1.0 if block == 1 else block * (1.5 if cost.verifications <= 2 else 0.5))
    eng._propose = lambda seqs, ks: ([want[0].token_ids[len(s.output_ids):len(s.output_ids) + k]
                                      for s, k in zip(seqs, ks)], [None] * len(seqs))
    got, evs, rids = run(eng, [prompt], params)
    assert got[0].token_ids == want[0].token_ids
    kinds = step_kinds(evs, rids[0])
    print(f"steps: {kinds}; spec {got[0].spec}")
    pause = payoff.PLAIN_WARMUP + FIRST_PAUSE
    assert kinds.startswith("S" * payoff.SPEC_SAMPLES + "p" * pause + "S")
    assert "p" not in kinds[payoff.SPEC_SAMPLES + pause:]
    assert got[0].spec["paused_for_cost"] == FIRST_PAUSE and eng.spec_payoff.shapes[("eager", 1)].pauses == 1
