"""The float32 reference decode step (model.reference.reference_decode_step) against the float32
reference of the whole sequence, and the mega self-check's parts that run without a GPU: the sink
context and the per-row criterion."""

from __future__ import annotations

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.model.reference import reference_decode_step, reference_logits
from fgchat.engine.modes import as_close_as_eager, sink_context


def _engine(model_dir):
    return Engine(EngineConfig(model=str(model_dir), device="cpu", max_context=64, dtype="float32"))


def _step(eng, ids, pos, slots):
    dec = eng.decoder
    return reference_decode_step(eng.cfg, dec.w, ids, pos, slots, eng.cache.k, eng.cache.v, dec.cos, dec.sin,
                                 dec.scale)


def test_decode_step_equals_the_sequence_reference(tiny_llama):
    """Two rows in their own slots after their prompts were prefilled: each row's logits are the
    last row of the reference over prompt + token; reading another slot gives other logits."""
    eng = _engine(tiny_llama)
    eng.cache.all.normal_()  # rows past each prompt must not be read
    dec, v = eng.decoder, eng.cfg.vocab_size
    prompts = {3: [(5 * i + 1) % v for i in range(11)], 6: [(3 * i + 7) % v for i in range(23)]}
    for slot, p in prompts.items():
        dec.prefill(torch.tensor(p), slot, eng.cache.k, eng.cache.v)
    nxt = [17 % v, 29 % v]
    got = _step(eng, nxt, [len(p) for p in prompts.values()], list(prompts))
    for r, p in enumerate(prompts.values()):
        want = reference_logits(eng.cfg, dec.w, torch.tensor(p + [nxt[r]]), dec.cos, dec.sin, dec.scale)[-1]
        torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-4)
    swapped = _step(eng, nxt, [11, 23], [6, 3])  # each row over the other's cache
    assert (swapped[0] - got[0]).abs().max() > 1e-2


def test_sink_context_repeats_the_first_row(tiny_llama):
    """Positions [1, pos) of each row's slot hold its position-0 K/V in every layer; the rest of
    the cache is left as it was."""
    eng = _engine(tiny_llama)
    eng.cache.all.normal_()
    before = eng.cache.all.clone()
    sink_context(eng.program, [5, 9], [7, 30], [2, 4])
    kv = eng.cache.all
    for s, p in ((2, 7), (4, 30)):
        assert not torch.equal(kv[:, s, 0], before[:, s, 0])  # written by the position-0 step
        assert torch.equal(kv[:, s, 1:p], kv[:, s, :1].expand_as(kv[:, s, 1:p]))
        assert torch.equal(kv[:, s, p:], before[:, s, p:])
    others = [s for s in range(kv.shape[1]) if s not in (2, 4)]
    assert torch.equal(kv[:, others], before[:, others])


def test_close_as_eager_criterion():
    """Noise of eager's size passes; an error far past twice eager's, a lost top-1 that eager kept,
    or a non-finite logit fails; where eager itself is far off, being as far off passes."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 500, generator=g) * 4
    ref[:, 7] = 30.0  # a clear top-1 in every row
    noise = torch.randn(3, 500, generator=g)
    bf16 = torch.bfloat16
    assert as_close_as_eager(ref + 0.05 * noise, ref + 0.05 * noise.flip(0), ref, bf16)
    far = ref + 2.0 * noise
    assert not as_close_as_eager(far, ref + 0.05 * noise, ref, bf16)
    lost = ref.clone()
    lost[1, 8] = 40.0
    assert not as_close_as_eager(lost, ref + 0.05 * noise, ref, bf16)
    nan = ref.clone()
    nan[2, 3] = float("nan")
    assert not as_close_as_eager(nan, ref, ref, bf16)
    assert as_close_as_eager(far, ref + 1.5 * noise.flip(1), ref, bf16)
