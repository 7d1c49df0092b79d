"""Pipelined decode (step n+1 launched before step n is read) yields what the plain loop yields.

On CUDA the pipeline is on by default; here it is forced on CPU, where the same bookkeeping runs
(inputs fed from the previous step's tokens on the device, lanes that finished dropped).
"""

from __future__ import annotations

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import RequestFinished, SamplingParams, TokenEvent


def _engine(path, pipeline: bool) -> Engine:
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_context=96))
    assert not eng.pipelined  # the CPU default
    eng.pipelined = pipeline
    return eng


def _run(eng: Engine, jobs, cancel_at: dict[int, int] | None = None):
    """jobs: (prompt, params, submit at step). Returns finished summaries by request order."""
    rids: list[int] = []
    events = []
    step = 0
    pending = list(jobs)
    while pending or eng.has_work():
        for job in [j for j in pending if j[2] == step]:
            rids.append(eng.submit(job[0], job[1]))
            pending.remove(job)
        for idx, at in (cancel_at or {}).items():
            if at == step and idx < len(rids):
                eng.cancel(rids[idx])
        events += eng.step()
        step += 1
        assert step < 2000
    done = {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}
    return [done[r] for r in rids], events


def _jobs(vocab: int, eos: int):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 19, 4, 30, 11, 9)]
    return [
        (prompts[0], SamplingParams(max_tokens=40, ignore_eos=True), 0),
        (prompts[1], SamplingParams(max_tokens=5, ignore_eos=True), 0),  # leaves early (length)
        (prompts[2], SamplingParams(max_tokens=60, temperature=0.9, top_p=0.9, seed=11), 2),
        (prompts[3], SamplingParams(max_tokens=25, temperature=1.3, top_k=20, seed=5), 9),
        (prompts[4], SamplingParams(max_tokens=70), 3),  # stops at EOS if the model emits it
        (prompts[5], SamplingParams(max_tokens=200, ignore_eos=True), 1),  # runs into the context end
    ]


def test_pipelined_tokens_equal_plain_loop(tiny_llama):
    plain = _engine(tiny_llama, False)
    piped = _engine(tiny_llama, True)
    jobs = _jobs(plain.cfg.vocab_size, 0)
    want, _ = _run(plain, jobs)
    got, events = _run(piped, jobs)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    assert "length" in {s.finish_reason for s in got}
    assert len(want[5].token_ids) < 200  # the context limit ended it, with no write past the cache
    # every emitted token belongs to a running request, once, in order
    for s in got:
        idx = [e.token_index for e in events if isinstance(e, TokenEvent) and e.request_id == s.request_id]
        assert idx == list(range(len(s.token_ids)))


def test_cancel_mid_stream_drops_the_in_flight_token(tiny_llama):
    plain = _engine(tiny_llama, False)
    piped = _engine(tiny_llama, True)
    jobs = _jobs(plain.cfg.vocab_size, 0)[:3]
    want, _ = _run(plain, jobs, cancel_at={0: 6})
    got, _ = _run(piped, jobs, cancel_at={0: 6})
    assert got[0].finish_reason == "cancelled" and want[0].finish_reason == "cancelled"
    # the cancelled request's tokens are a prefix of its uncancelled run; the others are unchanged
    full, _ = _run(_engine(tiny_llama, False), jobs)
    assert full[0].token_ids[: len(got[0].token_ids)] == got[0].token_ids
    assert [s.token_ids for s in got[1:]] == [s.token_ids for s in want[1:]]


def test_pipelined_engine_keeps_one_step_in_flight(tiny_llama):
    eng = _engine(tiny_llama, True)
    eng.submit([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    eng.step()  # admission: prefill token, then the first decode step is launched
    assert eng._inflight is not None and eng.has_work()
    n_tokens = 0
    while eng.has_work():
        n_tokens += sum(isinstance(e, TokenEvent) for e in eng.step())
    assert eng._inflight is None and n_tokens == 9
