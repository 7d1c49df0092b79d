"""Prefill CUDA graphs (one per token bucket) vs the eager fused prefill (H200; skipped without CUDA).

Run on the GPU: pytest -m gpu tests/gpu/test_gpu_prefill_graphs.py
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

    return tiny_models.head64_model(tmp_path_factory.mktemp("pg") / "m")


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


@pytest.fixture(scope="module")
def batch_engine(model):
    return Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=CTX, mode="full"))


@pytest.mark.parametrize("lens", [(32, 32), (5, 31, 17, 9, 30, 1, 12, 32), (100, 70, 128), (200, 250, 256, 3),
                                  (300, 512, 40), (512,) * 8])
def test_batch_route_graph_same_bits_as_eager(batch_engine, lens):
    """The batch route's graph (B prompts padded to one bucket, captured on first use) gives the
    eager batch route's logits and cache rows bit for bit, writes only rows [0, tb) of the
    prompts' slots, and each prompt's logits are as close to a float32 prefill of it alone as the
    one-prompt bf16 prefill is."""
    from fgchat.engine.model.prefill import batch_bucket, prefill_batch

    eng = batch_engine
    graphs = eng.modes.prefill_graphs
    tb = batch_bucket(list(lens), CTX)
    assert tb is not None
    slots = list(range(len(lens)))[::-1]
    prompts = [(ids_of(n, 70 + n + j, eng.cfg.vocab_size), s) for j, (n, s) in enumerate(zip(lens, slots))]
    k, v = eng.cache.k, eng.cache.v
    for t in k + v:
        t.fill_(float("nan"))
    want = [x.clone() for x in prefill_batch(eng.decoder, prompts, tb, k, v)]
    want_kv = [t.clone() for t in k + v]
    for t in k + v:
        t.fill_(float("nan"))
    got = [x.clone() for x in graphs.run_batch(prompts, tb)]
    torch.cuda.synchronize()
    assert (len(lens), tb) in graphs.batch_graphs
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for t, w in zip(k + v, want_kv):
        assert torch.equal(torch.nan_to_num(t, 7.0), torch.nan_to_num(w, 7.0))
        assert torch.isnan(t[:, tb:]).all()
    unused = [s for s in range(k[0].shape[0]) if s not in slots]
    assert all(torch.isnan(t[unused]).all() for t in k + v)
    for (ids, slot), g in zip(prompts, got):  # against float32 of the same prompt alone
        ref = _float32_prefill(eng, ids)
        alone = eng.decoder.prefill(ids, 7, k, v).float()
        scale = ref.abs().max().item()
        err, err_alone = (g - ref).abs().max().item(), (alone - ref).abs().max().item()
        assert torch.isfinite(g).all() and err <= 2.0 * err_alone + 1e-2 * scale, (slot, err, err_alone)


def _float32_prefill(eng: Engine, ids: torch.Tensor) -> torch.Tensor:
    """Last logits of `ids` prefilled alone by the unfused path in float32 from the engine's
    (rounded) weights."""
    from small_decoders import as_float32

    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.model.decoder import Decoder

    dec = Decoder(eng.cfg, as_float32(eng.model.weights), CTX, fused=False)
    cache = KVCache(eng.cfg, ids.shape[0] + 1, torch.device("cuda"), torch.float32)
    return dec.prefill(ids, 0, cache.k, cache.v)


def test_batch_route_tokens_equal_in_full_and_eager(batch_engine):
    """Eight distinct prompts admitted in one round take the batch route (a graph in full mode,
    the same kernels eagerly otherwise): every mode gives the same tokens."""
    eng = batch_engine
    v = eng.cfg.vocab_size
    prompts = [ids_of(n, 300 + n, v).tolist() for n in (20, 32, 7, 31, 16, 25, 3, 29)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {}
    for mode in ("full", "eager", "piecewise"):
        eng.set_mode(mode)
        rids = [eng.submit(p, sp) for p in prompts]
        done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        out[mode] = [done[r].token_ids for r in rids]
    assert (8, 32) in eng.modes.prefill_graphs.batch_graphs
    assert out["full"] == out["eager"] == out["piecewise"]


def test_decode_graphs_captured_again_after_a_batch_capture_give_the_same_tokens(model):
    """The batch route's first capture comes after the decode graphs: they are stale, an idle
    pass captures every one again (new graph objects, the same sizes), and the greedy tokens of a
    batch after it are those before it; both match eager mode's."""
    from fgchat.protocol.events import Mode

    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=1024, mode="full"))
    v = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=16, ignore_eos=True)

    def batch(prompts: list[list[int]]) -> list[list[int]]:
        rids = [eng.submit(p, sp) for p in prompts]
        done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        return [done[r].token_ids for r in rids]

    def idle() -> int:
        passes = 0
        while eng.capture_idle():
            passes += 1
        return passes

    short = [ids_of(n, 90 + n, v).tolist() for n in (20, 9, 31)]
    before = batch(short)  # the batch route at 32: captured on first use, after the decode graphs
    assert (3, 32) in eng.modes.prefill_graphs.batch_graphs and eng.modes.decode_stale()
    idle()
    full = eng.modes.modes[Mode.FULL]
    held = dict(full.graphs)
    assert not eng.modes.decode_stale() and held
    batch([ids_of(n, 95 + n, v).tolist() for n in (300, 200)])  # the batch route at 384
    assert (2, 384) in eng.modes.prefill_graphs.batch_graphs and eng.modes.decode_stale()
    from fgchat.engine.modes import GRAPH_MODES

    sizes = sum(len({b for b, _ in getattr(eng.modes.modes.get(m), "graphs", {})}) for m in GRAPH_MODES)
    assert idle() == sizes and not eng.modes.decode_stale()  # one (mode, size) a pass, piecewise's too
    assert set(full.graphs) == set(held) and all(full.graphs[k] is not held[k] for k in held)
    assert batch(short) == before
    eng.set_mode("eager")
    assert batch(short) == before
