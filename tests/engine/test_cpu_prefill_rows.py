"""CPU prefill through oneDNN (bf16; float32 with packed weights) pads its rows to a bounded set of
sizes (prefill.cpu_prefill_rows): the padding rows never reach the cache or the logits."""

import pytest
import torch

from fgchat.engine.kv_cache import KVCache
from fgchat.engine.loader import load_model
from fgchat.engine.model.cpu_linear import PackedProjections
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.model.prefill import cpu_prefill_rows, prefill_many

CPU = torch.device("cpu")


def test_row_sizes_are_bounded_and_cover_every_count():
    sizes = {cpu_prefill_rows(n) for n in range(1, 2049)}
    assert len(sizes) <= 48
    assert all(cpu_prefill_rows(n) >= n for n in range(1, 9000))
    assert [cpu_prefill_rows(n) for n in (1, 8, 16)] == [1, 8, 16]  # decode and short prompts as they are


def _decoder(path, dtype):
    m = load_model(str(path), CPU, dtype)
    dec = Decoder(m.cfg, m.weights, 128, fused=False)
    cache = KVCache(m.cfg, 128, CPU, dtype)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))  # a padding row written to the cache would show as a number
    return m.cfg, dec, cache


def test_bf16_prefill_pads_rows_and_matches_float32(tiny_llama, monkeypatch):
    cfg, dec, cache = _decoder(tiny_llama, torch.bfloat16)
    _, ref, ref_cache = _decoder(tiny_llama, torch.float32)
    ids = torch.randint(3, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    seen: list[int] = []
    project = dec.project

    def recording(x, i, role):
        seen.append(x.shape[0])
        return project(x, i, role)

    monkeypatch.setattr(dec, "project", recording)
    all_logits = dec.prefill(ids, 2, cache.k, cache.v, all_logits=True)
    last = dec.prefill(ids, 5, cache.k, cache.v)
    monkeypatch.undo()
    # every projection of the all-rows prefill, and of the last-row one up to its last layer's o and
    # MLP, which run on the last row alone
    per_layer = 4 * cfg.num_layers
    assert len(seen) == 2 * per_layer and set(seen[:2 * per_layer - 3]) == {cpu_prefill_rows(37)} == {40}
    assert seen[-3:] == [1, 1, 1]
    assert all_logits.shape == (37, cfg.vocab_size) and last.shape == (cfg.vocab_size,)
    want = ref.prefill(ids, 2, ref_cache.k, ref_cache.v, all_logits=True)
    torch.testing.assert_close(last, all_logits[-1], rtol=0.02, atol=0.02)  # a 1-row product rounds otherwise
    torch.testing.assert_close(all_logits, want, rtol=0.05, atol=0.05)  # bf16 against float32
    for k, v in zip(cache.k, cache.v):
        for slot in (2, 5):
            assert not k[slot, :37].isnan().any() and not v[slot, :37].isnan().any()
            assert k[slot, 37:].isnan().all() and v[slot, 37:].isnan().all()


def test_bf16_prefill_many_pads_the_stacked_rows(tiny_llama):
    cfg, dec, cache = _decoder(tiny_llama, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, cfg.vocab_size, (17,), generator=g)
    b = torch.randint(3, cfg.vocab_size, (20,), generator=g)
    with torch.inference_mode():
        la, lb = prefill_many(dec, [(a, 0), (b, 1)], cache.k, cache.v)
        alone = dec.prefill(b, 3, cache.k, cache.v)
    torch.testing.assert_close(lb, alone, rtol=0.02, atol=0.02)
    assert la.shape == lb.shape == (cfg.vocab_size,)
    assert cache.k[0][0, 17:].isnan().all() and cache.k[0][1, 20:].isnan().all()


@pytest.mark.parametrize("packed", [True, False])
def test_float32_prefill_pads_only_with_packed_weights(tiny_llama, monkeypatch, packed):
    """float32 on MKL (F.linear) keeps no memory per row count: its rows stay as they are."""
    if not packed:  # where oneDNN declines the packed copies, F.linear
        monkeypatch.setattr(PackedProjections, "prepare", classmethod(lambda cls, weights: None))
    cfg, dec, cache = _decoder(tiny_llama, torch.float32)
    if packed and dec._packed is None:
        pytest.skip("torch built without oneDNN")
    seen: list[int] = []
    project = dec.project
    monkeypatch.setattr(dec, "project", lambda x, i, role: seen.append(x.shape[0]) or project(x, i, role))
    logits = dec.prefill(torch.arange(3, 40), 0, cache.k, cache.v, all_logits=True)
    assert len(seen) == 4 * cfg.num_layers and set(seen) == {40 if packed else 37}
    assert logits.shape == (37, cfg.vocab_size) and torch.isfinite(logits).all()
    assert not cache.k[0][0, :37].isnan().any() and cache.k[0][0, 37:].isnan().all()
