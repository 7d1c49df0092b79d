"""The verification step as a decode step over B x (k + 1) rows (issue 55), on CPU: each row's
logits those of decoding its sequence one token at a time (several rows on one slot, the causal
mask inside a block from per-row lengths, padded rows harmless, for the sdpa and torch attention
backends); greedy speculation in float32 token for token plain decoding at batch 1..4 with
ragged acceptance; the verification runs in the engine's mode, a graph per (B, k + 1) captured
once before its step, its TokenEvents naming mode and graph, a failed capture announced and run
eager. Graph modes on CPU are stand-ins (eager steps behind a graph mode's interface)."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine
from fgchat.engine.speculate.verify import block_rows
from fgchat.engine.step import Variant
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.events import Mode, ModeChanged, RequestFinished, SamplingParams, TokenEvent
from stand_in_modes import StandInGraphMode

REPEATING = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


def engine(**kw) -> Engine:
    kw.setdefault("preset", "tiny")
    kw.setdefault("dtype", "float32")
    return Engine(EngineConfig(device="cpu", seed=3, **kw))


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    rids = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
    evs = eng.run_until_done()
    done = {e.summary.request_id: e.summary for e in evs if isinstance(e, RequestFinished)}
    return [done[r] for r in rids], evs


def test_block_rows_pad_each_sequence_to_the_block_and_stay_inside_the_cache():
    ids, pos, slots, block = block_rows([1, 2, 3], [[10, 11, 12], [], [20]], [5, 9, 63], [4, 0, 2], 64)
    assert block == 4
    assert ids == [1, 10, 11, 12, 2, 2, 2, 2, 3, 20, 20, 20]
    assert pos == [4, 5, 6, 7, 8, 9, 10, 11, 62, 63, 63, 63]  # real rows at len - 1 + j; pads clamped
    assert slots == [4] * 4 + [0] * 4 + [2] * 4


@pytest.mark.parametrize("attention", ["sdpa", "torch"])
def test_verification_rows_are_decoding_one_token_at_a_time(attention):
    """Three sequences of ragged lengths and drafts (3, 0, 2: block 4) verified in one step: each
    real row's logits and pick equal those of plain decode steps feeding the same tokens one at a
    time (the reference, run first on a copy of the cache). Rows past each prompt are NaN before
    the verification: a row that read a position its block had not written would show."""
    eng = engine(attention=attention, max_context=64)
    prog, dec, cache = eng.program, eng.decoder, eng.cache
    prompts = [random_prompt(n, 10 + n) for n in (7, 12, 3)]
    drafts = [random_prompt(3, 1), [], random_prompt(2, 2)]
    lasts = [101, 102, 103]  # each sequence's last token, not yet in the cache
    slots = [3, 0, 5]
    with torch.inference_mode():
        for p, s in zip(prompts, slots):
            dec.prefill(torch.tensor(p), s, cache.k, cache.v)
        saved = cache.all.clone()
        want_logits, want_picks = [], []
        for p, s, last, d in zip(prompts, slots, lasts, drafts):  # the reference: plain steps
            for j, tok in enumerate([last] + d):
                prog.bufs.stage([tok], [len(p) + j], [s], [0.0], [1.0], [0], [0])
                prog.max_len_hint = len(p) + j + 1
                out = prog.run_eager(1, Variant.SAMPLED)  # exact logits (temperature 0 picks the argmax)
                want_logits.append(out.logits[0].clone())
                want_picks.append(int(torch.argmax(out.logits[0])))
        cache.all.copy_(saved)
        for p, s in zip(prompts, slots):
            cache.all[:, s, len(p):] = float("nan")
        ids, pos, rows_slots, block = block_rows(lasts, drafts, [len(p) + 1 for p in prompts], slots, 64)
        n = len(ids)
        got = {}
        for variant in (Variant.SAMPLED, Variant.GREEDY):
            prog.bufs.stage(ids, pos, rows_slots, [0.0] * n, [1.0] * n, [0] * n, [0] * n)
            prog.max_len_hint = max(pos) + 1
            out = prog.run_eager(3, variant, block)
            got[variant] = (out.logits[:n].clone(), out.tokens[:n].tolist())
    real = [i * block + j for i, d in enumerate(drafts) for j in range(len(d) + 1)]
    logits, picks = got[Variant.SAMPLED]
    for r, want in zip(real, want_logits):
        assert torch.allclose(logits[r], want, rtol=1e-4, atol=1e-4), (r, (logits[r] - want).abs().max())
    assert [picks[r] for r in real] == want_picks
    assert [got[Variant.GREEDY][1][r] for r in real] == want_picks  # the greedy head's own pick


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_greedy_speculation_in_float32_is_plain_decoding_with_ragged_acceptance(b):
    prompts = [REPEATING, random_prompt(9, 5), REPEATING[3:] + REPEATING[:3], random_prompt(15, 6)][:b]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 13, 19, 8)][:b]
    want, _ = run(engine(), prompts, params)
    got, evs = run(engine(speculate="ngram", draft_len=4), prompts, params)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert got[0].spec["accepted"] > 0
    if b > 1:
        assert len({s.spec["accepted"] for s in got}) > 1  # each lane accepted its own
    spec_tokens = [e for e in evs if isinstance(e, TokenEvent) and e.draft_len > 0]
    assert spec_tokens and all(e.mode == "eager" and e.graph is None for e in spec_tokens)


@pytest.mark.parametrize("mode", [Mode.FULL, Mode.PIECEWISE])
def test_verification_runs_in_the_engines_mode_one_graph_per_shape(mode):
    plain = engine()
    params = [SamplingParams(max_tokens=20, ignore_eos=True)]
    want, _ = run(plain, [REPEATING], params)
    eng = engine(speculate="oracle", draft_len=4)
    runner = StandInGraphMode(eng, mode)
    eng.modes.install(mode, runner)
    assert eng.set_mode(str(mode)).mode == mode
    eng.spec_oracle.record(REPEATING, want[0].token_ids)
    got, evs = run(eng, [REPEATING], params)
    assert got[0].token_ids == want[0].token_ids
    spec = [e for e in evs if isinstance(e, TokenEvent) and e.draft_len > 0]
    assert spec and all(e.mode == mode for e in spec)
    assert {e.graph for e in spec} <= {f"{mode}/b1k{k}" for k in range(1, 5)} and f"{mode}/b1k4" in {e.graph for e in spec}
    captures = [x for x in runner.log if x[0] == "capture"]
    assert len(captures) == len(set(captures))  # each shape captured once
    assert ("capture", 1, 5) in captures and ("run", 1, 5) in runner.log
    assert not any(isinstance(e, ModeChanged) and e.reason for e in evs)


def test_a_failed_verification_capture_runs_eager_and_says_why():
    eng = engine(speculate="oracle", draft_len=3)
    want, _ = run(engine(), [REPEATING], [SamplingParams(max_tokens=12, ignore_eos=True)])
    eng.modes.install(Mode.FULL, StandInGraphMode(eng, Mode.FULL, fail_blocks=True))
    eng.set_mode("full")
    eng.spec_oracle.record(REPEATING, want[0].token_ids)
    got, evs = run(eng, [REPEATING], [SamplingParams(max_tokens=12, ignore_eos=True)])
    assert got[0].token_ids == want[0].token_ids
    changed = [e for e in evs if isinstance(e, ModeChanged) and e.reason]
    assert changed and "verification" in changed[0].reason and "running eager" in changed[0].reason
    spec = [e for e in evs if isinstance(e, TokenEvent) and e.draft_len > 0]
    assert spec and all(e.mode == "eager" and e.graph is None for e in spec)
    assert eng.mode == Mode.EAGER


def test_mega_verifies_in_full_or_eager():
    eng = engine()
    assert eng.modes.verify_mode(Mode.MEGA) == Mode.EAGER  # CPU: no full graphs
    eng.modes.install(Mode.FULL, StandInGraphMode(eng, Mode.FULL))
    assert eng.modes.verify_mode(Mode.MEGA) == Mode.FULL
    assert eng.modes.verify_mode(Mode.PIECEWISE) == Mode.PIECEWISE


@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_speculating_requests_capture_nothing_after_the_idle_captures(method):
    """The verification block is K + 1 whatever the drafts (ngram's vary, the last steps have no
    room for K): one shape per (batch size, variant), captured by capture_sizes and while idle,
    after the decode graphs. Requests that end one by one (batch 3, 2, 1) then decode with no
    capture (the stand-in's log), every verification at block K + 1, greedy output plain's."""
    prompts = [REPEATING, REPEATING[2:] + REPEATING[:2], random_prompt(9, 5)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (23, 14, 9)]
    want, _ = run(engine(), prompts, params)
    eng = engine(speculate=method, draft_len=4)
    runner = StandInGraphMode(eng, Mode.FULL)
    eng.modes.install(Mode.FULL, runner)
    eng.set_mode("full")
    eng.capture_sizes("full", [1, 2, 3])  # CPU has no idle queue of decode graphs: taken here
    while eng.capture_idle():
        pass
    verify = {(b, block) for what, b, block in runner.log if what == "capture" and block > 1}
    assert verify == {(b, 5) for b in range(1, 9)} and len(runner.captured) == 3 + 2 * 8
    for p, w in zip(prompts, want):
        eng.spec_oracle.record(p, w.token_ids)
    start = len(runner.log)
    got, evs = run(eng, prompts, params)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    during = runner.log[start:]
    assert not [x for x in during if x[0] == "capture"]
    assert {block for what, b, block in during if block > 1} == {5} and {b for _, b, _ in during} == {1, 2, 3}
    spec = [e for e in evs if isinstance(e, TokenEvent) and e.draft_len > 0]
    assert len({e.draft_len for e in spec}) > 1 and {e.graph for e in spec} <= {f"full/b{b}k4" for b in (1, 2, 3)}
