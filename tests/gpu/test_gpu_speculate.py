"""Speculative decoding on the GPU: greedy output token for token the plain engine's in eager,
piecewise and full (the verification pass runs eagerly between the mode's plain steps), a ragged
batch, and the oracle's tokens/s at k = 4 against plain decoding in the same mode, printed.

Run on the GPU: pytest -m gpu -s tests/gpu/test_gpu_speculate.py
"""

from __future__ import annotations

import time

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import RequestFinished, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPEATING = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7] * 3


def random_ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(eng: Engine, prompts: list[list[int]], n: int) -> tuple[list, float]:
    rids = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    done = {ev.summary.request_id: ev.summary for ev in eng.run_until_done() if isinstance(ev, RequestFinished)}
    return [done[r] for r in rids], time.perf_counter() - t0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny_models

    return tiny_models.head64_model(tmp_path_factory.mktemp("spec") / "m")


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full"])
@pytest.mark.parametrize("method", ["ngram", "oracle", "draft"])
def test_greedy_speculation_is_plain_decoding_in_every_mode(model, mode, method):
    kw = dict(model=str(model), device="cuda", dtype="float32", max_context=1024, mode=mode)
    plain = Engine(EngineConfig(**kw))
    prompts = [REPEATING, random_ids(40, 1, plain.cfg.vocab_size), REPEATING[5:], random_ids(9, 2, 300)]
    want, _ = run(plain, prompts, 48)
    extra = dict(draft=str(model)) if method == "draft" else {}
    eng = Engine(EngineConfig(speculate=method, **extra, **kw))
    if method == "oracle":
        run(eng, prompts, 48)  # records the continuations
    got, _ = run(eng, prompts, 48)
    print(f"{mode} {method}: acceptance {[round(s.spec['acceptance_rate'], 2) for s in got]} "
          f"tokens/step {[round(s.spec['tokens_per_step'], 2) for s in got]}")
    assert [s.token_ids for s in got] == [s.token_ids for s in want]


@pytest.mark.parametrize("batch", [1, 8])
def test_oracle_tokens_per_second_at_k4(batch):
    """Llama-3.2-1B's shape, random bf16 weights: plain `full` against `full` + oracle at k = 4
    (printed; the issue's targets: >= 3x at batch 1, >= 2x at batch 8)."""
    kw = dict(preset="llama-3.2-1b", device="cuda", max_context=2048, mode="full")
    eng = Engine(EngineConfig(speculate="oracle", draft_len=4, **kw))
    prompts = [random_ids(128, 10 + i, eng.cfg.vocab_size) for i in range(batch)]
    n = 256
    eng.set_speculation("off")
    run(eng, prompts, n)  # warm-up and the oracle's record
    plain, t_plain = run(eng, prompts, n)
    eng.set_speculation("oracle")
    spec, t_spec = run(eng, prompts, n)
    tok = sum(s.output_tokens for s in plain)
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    print(f"batch {batch}: plain full {tok / t_plain:.0f} tok/s, oracle k=4 {tok / t_spec:.0f} tok/s "
          f"({t_plain / t_spec:.2f}x), acceptance {[round(s.spec['acceptance_rate'], 3) for s in spec]}, "
          f"tokens/step {[round(s.spec['tokens_per_step'], 2) for s in spec]}, identical {same}/{batch}")
    assert all(s.spec["proposed"] > 0 for s in spec)
