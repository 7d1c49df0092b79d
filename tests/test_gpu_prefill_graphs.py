"""Prefill CUDA graphs (one per token bucket) vs the eager fused prefill (H200; skipped without CUDA).

Run on the GPU: pytest -m gpu tests/test_gpu_prefill_graphs.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import RequestFinished, SamplingParams
from fgchat.engine.model.prefill import PREFILL_BUCKETS, bucket_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CTX = 2560


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny_models

    return tiny_models.build_model(tmp_path_factory.mktemp("pg") / "m", "llama", hidden=512, layers=3,
                                   heads=8, kv_heads=2, head_dim=64, intermediate=1024, max_pos=8192, seed=9)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=CTX, mode="full"))


def ids_of(n: int, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).cuda()


def test_every_bucket_captured_at_start(engine):
    info = engine.info()
    pre = sorted(c.batch_size for c in info.captures if c.kind == "prefill")
    assert pre == [b for b in PREFILL_BUCKETS if b <= CTX]
    assert all(c.mode == "full" for c in info.captures if c.kind == "prefill")
    assert sum(c.pool_mib for c in info.captures) <= 512


@pytest.mark.parametrize("n", [1, 31, 32, 33, 300, 512, 777, 2048, 2100])
def test_graph_prefill_same_bits_as_eager(engine, n):
    """Same logits and the same cache rows [0, n) as the eager fused prefill of the same prompt
    (which pads to the same bucket); prompts past the last bucket prefill eagerly."""
    graphs = engine.modes.prefill_graphs
    ids = ids_of(n, n, engine.cfg.vocab_size)
    assert graphs.covers(n) == (n <= max(graphs.buckets))
    k, v = engine.cache.k, engine.cache.v
    for t in k + v:
        t[6].fill_(float("nan"))
    want = engine.decoder.prefill(ids, 6, k, v).clone()
    want_kv = [t[6, :n].clone() for t in k + v]
    for t in k + v:
        t[6].fill_(float("nan"))
    got = graphs.run(ids, 6) if graphs.covers(n) else engine.decoder.prefill(ids, 6, k, v)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert all(torch.equal(t[6, :n], w) for t, w in zip(k + v, want_kv))
    if graphs.covers(n):  # rows past the bucket are never written
        b = bucket_for(n, CTX)
        assert all(torch.isnan(t[6, b:]).all() for t in k + v)


def _tokens(eng: Engine, mode: str, prompts, sp) -> list[list[int]]:
    """Each prompt's tokens, the prompts submitted one at a time (each prefilled alone: in full
    mode through its bucket's prefill graph)."""
    eng.set_mode(mode)
    out = []
    for p in prompts:
        rid = eng.submit(p, sp)
        done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        out.append(done[rid].token_ids)
    return out


def test_full_mode_tokens_equal_eager_with_prefill_graphs(engine):
    v = engine.cfg.vocab_size
    prompts = [ids_of(n, 40 + n, v).tolist() for n in (5, 64, 200, 513, 1500)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    assert _tokens(engine, "full", prompts, sp) == _tokens(engine, "eager", prompts, sp)


def test_lazy_capture_while_another_request_decodes(model):
    """A bucket captured on first use (lazy) while another request is decoding: the capture's
    warm-up writes only the new request's slot, so the running request's text is unchanged."""
    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=CTX,
                              mode="full", lazy_capture=True))
    v = eng.cfg.vocab_size
    a, b = ids_of(100, 1, v).tolist(), ids_of(900, 2, v).tolist()
    # only the start-up check's short prompt has been prefilled (and its bucket captured)
    from fgchat.engine.model.prefill import bucket_for

    assert eng.modes.prefill_graphs is not None
    before = set(eng.modes.prefill_graphs.graphs)
    assert not before & {bucket_for(len(a), CTX), bucket_for(len(b), CTX)}
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = _tokens(eng, "eager", [a], sp)[0]
    eng.set_mode("full")
    ra = eng.submit(a, sp)
    events = []
    for _ in range(10):
        events += eng.step()
    rb = eng.submit(b, sp)
    events += eng.run_until_done()
    done = {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}
    assert done[ra].token_ids == alone
    assert done[rb].token_ids == _tokens(eng, "eager", [b], sp)[0]
    assert set(eng.modes.prefill_graphs.graphs) - before == {bucket_for(100, CTX), bucket_for(900, CTX)}
