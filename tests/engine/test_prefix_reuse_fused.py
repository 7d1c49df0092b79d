"""The fused path's prefill after cached rows (prefill.prefill_after on a fused decoder: Triton
kernels under the interpreter, TRITON_INTERPRET=1, in a subprocess) against the float32 reference
(model.reference) of the whole prompt, and the engine's rule for when a suffix prefill runs."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from fgchat.engine.core import Engine
from fgchat.engine.prefix_reuse import SlotHistory
from fgchat.protocol.events import Mode
from small_decoders import run_interpreted

AFTER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, "tests")
    from small_decoders import as_float32, scaled_weights, small_config
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.model.prefill import prefill_after
    from fgchat.engine.model.reference import reference_logits
    from fgchat.engine.kv_cache import KVCache

    out = []
    for heads, kv_heads, bias, dtype, split in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        cfg = small_config(heads, kv_heads, bias)
        w = scaled_weights(cfg, dtype)
        ids = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(2))
        dec = Decoder(cfg, w, 64, fused=True)
        ref = reference_logits(cfg, as_float32(w), ids, dec.cos, dec.sin, dec.scale)[-1]
        cache = KVCache(cfg, 64, torch.device("cpu"), dtype)
        for t in cache.k + cache.v:
            t.fill_(float("nan"))
        dec.prefill(ids[:split], 3, cache.k, cache.v)
        after = prefill_after(dec, ids[split:], split, 3, cache.k, cache.v)
        fresh_cache = KVCache(cfg, 64, torch.device("cpu"), dtype)
        fresh = dec.prefill(ids, 5, fresh_cache.k, fresh_cache.v)
        untouched = all(torch.isnan(t[torch.arange(8) != 3]).all().item() for t in cache.k + cache.v)
        kv = max((a[3, :37].float() - b[5, :37].float()).abs().max().item()
                 for a, b in zip(cache.k + cache.v, fresh_cache.k + fresh_cache.v))
        out.append(dict(after=(after - ref).abs().max().item(), fresh=(fresh - ref).abs().max().item(),
                        scale=ref.abs().max().item(), argmax=int(after.argmax()) == int(ref.argmax()),
                        finite=bool(torch.isfinite(after).all()), untouched=untouched, kv=kv,
                        dtype=str(after.dtype)))
    print("RESULT " + json.dumps(out))
    """
)


def test_fused_prefill_after_cached_rows_gives_the_float32_reference_logits():
    pytest.importorskip("triton")
    cases = [(4, 2, False, "float32", 20), (4, 2, False, "float32", 36), (6, 2, True, "float32", 33),
             (4, 4, False, "float32", 1), (4, 2, False, "bfloat16", 20)]
    for case, r in zip(cases, run_interpreted(AFTER_SCRIPT, cases)):
        assert r["finite"] and r["untouched"] and r["dtype"] == "torch.float32", (case, r)
        if case[3] == "float32":
            assert r["after"] <= 1e-4 * max(r["scale"], 1.0), (case, r)
            assert r["kv"] <= 1e-5 * max(r["scale"], 1.0), (case, r)
            assert r["argmax"], (case, r)
        else:  # bf16: no further from float32 than twice a fresh bf16 prefill of the whole prompt
            assert r["after"] <= 2 * r["fresh"] + 1e-3 * r["scale"], (case, r)


def fake_engine(device: str, mode: Mode, covers: bool) -> SimpleNamespace:
    graphs = SimpleNamespace(covers=lambda t: covers) if covers is not None else None
    return SimpleNamespace(mode=mode, modes=SimpleNamespace(prefill_graphs=graphs),
                           device=SimpleNamespace(type=device))


@pytest.mark.parametrize("mode,covers,pays", [
    (Mode.FULL, True, False),  # a prefill graph runs the whole prompt faster than the eager suffix
    (Mode.FULL, False, True),  # longer than the last bucket: the whole prompt would run eagerly too
    (Mode.FULL, None, True),  # no prefill graphs
    (Mode.PIECEWISE, True, True),  # prefill graphs serve full mode only
    (Mode.EAGER, True, True),
])
def test_a_suffix_prefill_runs_where_the_whole_prompt_would_run_eagerly(mode, covers, pays):
    assert Engine._suffix_prefill_pays(fake_engine("cuda", mode, covers), 500) is pays


def test_without_reuse_a_slot_without_history_is_taken_and_histories_stay():
    h = SlotHistory(3)
    prompt = list(range(100, 200))
    h.record(0, prompt[:80])
    assert h.choose(prompt, [0, 1, 2]) == (0, 80, None)
    assert h.choose(prompt, [0, 1, 2], reuse=False) == (1, 0, None)
    assert h.choose(prompt, [0], reuse=False) == (0, 0, None)


@pytest.mark.parametrize("device,setting,on", [
    ("cpu", None, True), ("cuda", None, False), ("cuda", True, True), ("cpu", False, False)])
def test_reuse_is_on_for_cpu_by_default_and_on_cuda_where_forced(device, setting, on):
    from fgchat.protocol.tuning import Tuning

    eng = SimpleNamespace(tuning=Tuning(prefix_reuse=setting), device=SimpleNamespace(type=device))
    assert Engine.reuses_prefixes.fget(eng) is on
