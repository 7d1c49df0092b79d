"""The draft model decodes through its own step program (speculate.draft_steps; eager on CPU):
over rounds of a ragged batch (prompts of different lengths, draft lengths 0..6, acceptance
simulated per sequence, a sequence left out of a round so its catch-up grows past the block
step's rows) it proposes exactly what the prefill-after-cached-rows path proposes from scratch
(the earlier eager proposer: verify_logits' argmax, or its draw from q for a sampled sequence),
each proposal running one step per draft in the mode asked for. At engine level: the draft's
steps run its step program, follow the target into (stand-in, CPU) full mode with their own
captures, and fall back to eager with a note where the draft's capture fails."""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kv_cache import KVCache
from fgchat.engine.loader import load_random
from fgchat.engine.requests import Sequence
from fgchat.engine.speculate.draft import DraftModel
from fgchat.engine.speculate.verify import verify_logits
from fgchat.protocol.events import EngineInfo, Mode, ModeChanged, RequestFinished, SamplingParams
from stand_in_modes import StandInGraphMode

MAX_CONTEXT = 128


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(draft: DraftModel, cache: KVCache, seq: Sequence, k: int) -> tuple[list[int], torch.Tensor | None]:
    """k drafts decoded by the prefill path, each over the whole sequence so far in a cache of
    its own (nothing reused), picked as the proposer picks (DraftModel._pick)."""
    tokens = seq.prompt_ids + seq.output_ids
    out, qs = [], []
    for _ in range(k):
        logits = verify_logits(draft.dec, [(tokens + out, 0, seq.slot)], cache.k, cache.v)[0][-1:]
        tok, q = draft._pick([seq], logits, [len(tokens) + len(out)])[0]
        out.append(tok)
        if q is not None:
            qs.append(q)
    return out, torch.stack(qs) if qs else None


REPEATING = [5, 6, 7, 8, 9, 10, 11] * 3
PROMPTS = [REPEATING, prompt(30, 1), REPEATING[4:], prompt(9, 2)]
LENGTHS = [24, 16, 20, 9]
KW = dict(preset="tiny", seed=3, device="cpu", dtype="float32", max_context=256)


def go(eng: Engine) -> tuple[list, list]:
    """The four prompts as one ragged batch, greedy: (summaries in order, every event)."""
    rids = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, LENGTHS)]
    evs = eng.run_until_done()
    done = {e.summary.request_id: e.summary for e in evs if isinstance(e, RequestFinished)}
    return [done[r] for r in rids], evs


@pytest.mark.parametrize("sampled", [False, True])
def test_draft_steps_propose_what_the_prefill_path_proposes(sampled):
    loaded = load_random("tiny", torch.device("cpu"), torch.float32, 11)
    draft = DraftModel(loaded, MAX_CONTEXT, fused=False)
    ref_cache = KVCache(loaded.cfg, MAX_CONTEXT, torch.device("cpu"), torch.float32)
    params = [SamplingParams(max_tokens=64)] * 4
    if sampled:  # one sampled lane: the batch's steps read logits on the host
        params[2] = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=64)
    seqs = [Sequence(i, prompt(n, i), p, frozenset(), 0, slot=s)
            for i, (n, p, s) in enumerate(zip((5, 31, 12, 2), params, (3, 0, 6, 1)))]
    g = torch.Generator().manual_seed(7)
    rounds = [[4, 2, 3, 6], [1, 4, 4, 0], [3, 3, 5, 2], [2, 0, 1, 4], [6, 5, 2, 3]]
    for r, ks in enumerate(rounds):
        drafts, qs = draft.propose(seqs, ks, Mode.EAGER)
        for seq, k, d, q in zip(seqs, ks, drafts, qs):
            want, want_q = reference(draft, ref_cache, seq, k)
            assert d == want, f"round {r}, sequence {seq.request_id}: {d} != {want}"
            if want_q is None:
                assert q is None
            else:
                torch.testing.assert_close(q, want_q, rtol=1e-4, atol=1e-6)
        assert draft.modes_ran == [Mode.EAGER] * max(ks)  # one step per draft, in the mode asked for
        for seq, k, d in zip(seqs, ks, drafts):  # the target accepts a prefix and adds its own token
            n_before = seq.length
            m = int(torch.randint(0, len(d) + 1, (1,), generator=g))
            if r == 0 and seq.request_id == 0:
                m = len(d)  # every draft accepted: a catch-up of two rows
            seq.output_ids += d[:m] + [int(torch.randint(3, 500, (1,), generator=g))]
            if k == 0:  # left out of the round: plain steps add more tokens the draft has not seen
                seq.output_ids += prompt(3, 100 + r)
            draft.settle(seq, n_before, len(d), m)
    print(f"sampled={sampled}: lengths {[s.length for s in seqs]}, valid {[draft.valid[s.slot] for s in seqs]}")


def test_the_engine_drafts_through_the_draft_step_program():
    """Engine level, CPU: every draft step runs the draft's StepProgram (its eager mode: CPU has
    no graphs) and greedy output is plain decoding's, drafts partly accepted (a ragged batch)."""
    want = go(Engine(EngineConfig(**KW)))[0]
    eng = Engine(EngineConfig(speculate="draft", draft="preset:tiny", draft_len=4, **KW))
    prog = eng._draft.steps.program
    calls = []
    run_eager = prog.run_eager
    prog.run_eager = lambda *a, **k: calls.append(a) or run_eager(*a, **k)  # type: ignore[method-assign]
    got = go(eng)[0]
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    proposed = [s.spec["proposed"] for s in got]
    accepted = [s.spec["accepted"] for s in got]
    print(f"proposed {proposed}, accepted {accepted}, draft steps {len(calls)} "
          f"(blocks {sorted({a[2] if len(a) > 2 else 1 for a in calls})})")
    assert sum(accepted) > 0 and sum(accepted) < sum(proposed)
    assert len(calls) >= max(proposed) and eng._draft.modes_ran and set(eng._draft.modes_ran) == {Mode.EAGER}
    assert not [r for r in eng.info().captures if r.kind.startswith("draft")]


@pytest.mark.parametrize("fail", [False, True])
def test_the_draft_follows_the_target_into_full_and_falls_back_to_eager_with_a_note(fail):
    """The target in (stand-in) full: the draft's steps run its own full mode, each shape captured
    before its first step and listed in EngineInfo.captures as "draft ..."; where the draft's
    capture fails, a note says so and its steps run eagerly, the target staying in full. Greedy
    output is plain decoding's either way."""
    want = go(Engine(EngineConfig(**KW)))[0]
    eng = Engine(EngineConfig(speculate="draft", draft="preset:tiny", draft_len=4, **KW))
    eng.modes.install(Mode.FULL, StandInGraphMode(eng, Mode.FULL))
    draft_full = StandInGraphMode(eng, Mode.FULL, fail_blocks=fail)  # the draft's first step is a block
    draft_full.program = eng._draft.steps.program
    eng._draft.steps.modes.install(Mode.FULL, draft_full)
    assert eng.set_mode("full").mode == "full"
    got, evs = go(eng)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert eng.mode == "full" and not any(isinstance(e, ModeChanged) and e.reason for e in evs)
    info = [e for e in evs if isinstance(e, EngineInfo)][-1]
    drafted = [r for r in info.captures if r.kind.startswith("draft ")]
    print(f"fail={fail}: draft log {draft_full.log[:8]}..., draft captures {[(r.kind, r.batch_size) for r in drafted]}")
    if fail:
        assert draft_full.log == [("capture", 4, 2)]  # the first shape failed; the mode is off for the draft
        assert any(n.startswith("draft model: full disabled: graph capture failed") for n in info.notes)
        assert set(eng._draft.modes_ran) == {Mode.EAGER} and not drafted
        return
    runs = [(b, k) for what, b, k in draft_full.log if what == "run"]
    assert set(eng._draft.modes_ran) == {Mode.FULL} and runs
    for what, b, k in draft_full.log:  # every shape captured once, before its first step
        if what == "capture":
            assert draft_full.log.count(("capture", b, k)) == 1
    assert {(r.kind, r.batch_size) for r in drafted} == {
        ("draft decode" if k == 1 else "draft verify", b) for b, k in set(runs)}
