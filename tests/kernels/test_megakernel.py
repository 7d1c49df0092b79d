"""The mega kernel (every decoder layer in one persistent launch) under Triton's interpreter,
phase by phase, against the plain torch decoder in float32.

The persistent launch (grid barriers) needs all programs resident at once, which only a GPU
gives; tests/gpu/test_gpu_megakernel.py runs it there against float32 and against these launches.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

from fgchat.engine.kernels.megakernel import DecodeLayers, norm_rows_only, pick_tiles  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(model_dir, max_context=96):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram

    from fgchat.protocol.tuning import Tuning

    # the plain decoder with the exact LM head: every logit of its steps is compared
    eng = Engine(EngineConfig(model=str(model_dir), device=DEV, max_context=max_context, dtype="float32",
                              tuning=Tuning(head_pick=False)))
    fused = StepProgram(Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True),
                        eng.cache, eng.bufs, eng.attention)
    g = torch.Generator(device=DEV).manual_seed(0)
    for t in eng.cache.k + eng.cache.v:
        t.copy_(torch.randn(t.shape, generator=g, device=DEV))
    return eng, fused


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("batch_rows_only", [False, True])
def test_layers_match_the_plain_decoder(tiny_llama, programs, b, batch_rows_only):
    """Logits, tokens and the K/V rows written, against the torch decoder's step; positions spread
    so attention splits are empty, partial and whole; the activation tiles of every projection
    whole or for the batch's rows only (V46, V47)."""
    from fgchat.engine.step import Variant

    eng, fused = _engine(tiny_llama)
    layers = DecodeLayers(fused.dec, eng.cache, programs=programs)
    layers.norm_batch_rows_only = layers.out_batch_rows_only = batch_rows_only
    layers.h.fill_(float("nan"))  # stale rows past the batch must never reach a stored output
    pos = [9, 70, 0, 33, 64, 1, 90, 5][:b]
    slots = [4, 0, 7, 1, 2, 3, 5, 6][:b]
    ids = [(7 * j + 5) % eng.cfg.vocab_size for j in range(b)]
    eng.bufs.stage(ids, pos, slots, [0.0] * b, [1.0] * b, [0] * b, [0] * b)
    eng.program.max_len_hint = 96
    before = eng.cache.all.clone()
    ref = eng.program.run_eager(b, Variant.GREEDY)
    ref_logits, ref_tokens, ref_kv = ref.logits.clone(), ref.tokens.clone(), eng.cache.all.clone()
    eng.cache.all.copy_(before)
    st_pieces = fused.mega_pieces(b, Variant.GREEDY, layers)
    out = _run(st_pieces, persistent=False, layers=layers)
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.tokens, ref_tokens)
    torch.testing.assert_close(eng.cache.all, ref_kv, rtol=1e-5, atol=1e-5)
    assert int(layers.cnt.abs().sum()) == 0  # every merge counter back at zero


def test_batch_rows_norm_is_off_unless_asked(tiny_llama):
    """Off by default (V46's launch is wrong on the GPU at 1B batch 1, notes session 24); None
    follows the per-shape rule (one row, a hidden size of 1B's or more), True forces it."""
    eng, fused = _engine(tiny_llama)
    layers = DecodeLayers(fused.dec, eng.cache, programs=1)
    assert layers.norm_batch_rows_only is False and not layers.norms_batch_rows(1)
    layers.norm_batch_rows_only = None
    assert eng.cfg.hidden_size < 2048 and not layers.norms_batch_rows(1)
    assert norm_rows_only(1, 2048) and norm_rows_only(1, 4096)
    assert not norm_rows_only(2, 2048) and not norm_rows_only(8, 4096) and not norm_rows_only(1, 576)
    layers.norm_batch_rows_only = True
    assert layers.norms_batch_rows(8)


@pytest.mark.parametrize("bni", [16, 64])
def test_wide_k_tiles_match_the_plain_decoder(tmp_path, bni):
    """K tiles of 512 in the down projection, gate/up items of 16 or 64 columns, and several
    items per program in every phase."""
    import tiny_models
    from fgchat.engine.step import Variant

    model = tiny_models.build_model(tmp_path / "m", hidden=128, heads=4, kv_heads=2, head_dim=32,
                                    intermediate=1024, seed=3)
    eng, fused = _engine(model)
    layers = DecodeLayers(fused.dec, eng.cache, programs=3)
    layers.set_tiles(pick_tiles(128, 128, 1024, 32, 3, max_k_out=512, bni=bni))
    assert (layers.tiles.bkh, layers.tiles.bki, layers.tiles.bni) == (128, 512, bni)
    assert min(layers.items_per_program().values()) > 1
    b, pos, slots = 3, [40, 3, 77], [2, 5, 0]
    eng.bufs.stage([11, 22, 33], pos, slots, [0.0] * b, [1.0] * b, [0] * b, [0] * b)
    eng.program.max_len_hint = 96
    before = eng.cache.all.clone()
    ref = eng.program.run_eager(b, Variant.GREEDY).logits.clone()
    eng.cache.all.copy_(before)
    out = _run(fused.mega_pieces(b, Variant.GREEDY, layers), persistent=False, layers=layers)
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)


def _run(pieces, persistent, layers):
    from fgchat.engine.model.decoder import StepState
    from fgchat.engine.step import StepOutputs

    run = layers.run
    layers.run = lambda ids, pos, slots: run(ids, pos, slots, persistent=persistent)
    try:
        st = StepState()
        for piece in pieces:
            piece(st)
    finally:
        layers.run = run
    return StepOutputs(st.tokens, st.logits)


def test_a_mutated_norm_is_seen(tiny_llama):
    """The comparison can fail: a layer norm's weight scaled changes the logits."""
    from fgchat.engine.step import Variant

    eng, fused = _engine(tiny_llama)
    eng.bufs.stage([5], [12], [0], [0.0], [1.0], [0], [0])
    eng.program.max_len_hint = 96
    ref = eng.program.run_eager(1, Variant.GREEDY).logits.clone()
    fused.dec.w.layers[1].mlp_norm.mul_(1.5)
    try:
        layers = DecodeLayers(fused.dec, eng.cache, programs=2)
        out = _run(fused.mega_pieces(1, Variant.GREEDY, layers), False, layers)
    finally:
        fused.dec.w.layers[1].mlp_norm.div_(1.5)
    assert not torch.allclose(out.logits, ref, rtol=1e-3, atol=1e-3)


def test_tiles_depend_on_shape_only():
    t = pick_tiles(2048, 2048, 8192, 64, 132)
    assert (t.bn, t.bni, t.pb, t.bkh, t.bkq, t.bki) == (16, 16, 16, 256, 512, 512)
    t = pick_tiles(576, 576, 1536, 64, 132, max_k_out=512)
    assert (t.bn, t.pb, t.bkh, t.bkq, t.bki) == (16, 16, 64, 64, 512)
    t = pick_tiles(2048, 2048, 8192, 64, 132, max_k=128, max_k_out=1024)
    assert (t.bkh, t.bkq, t.bki) == (128, 1024, 1024)
    assert pick_tiles(4096, 4096, 14336, 128, 132).bn == 16
    assert pick_tiles(8192, 8192, 28672, 128, 132).bn == 32
    with pytest.raises(ValueError):
        pick_tiles(100, 100, 100, 64, 132)


def test_set_programs_matches_a_layers_built_for_that_count(tiny_llama):
    """Changing the program count (the sweep's +ppsN) gives the tiles, statistics buffer and
    step of layers built for that count: the same logits as the plain decoder."""
    from fgchat.engine.step import Variant

    eng, fused = _engine(tiny_llama)
    layers = DecodeLayers(fused.dec, eng.cache, programs=2)
    layers.set_programs(7)
    fresh = DecodeLayers(fused.dec, eng.cache, programs=7)
    assert (layers.tiles, layers.np, layers.stats.shape) == (fresh.tiles, fresh.np, fresh.stats.shape)
    eng.bufs.stage([5, 9], [12, 40], [0, 3], [0.0] * 2, [1.0] * 2, [0] * 2, [0] * 2)
    eng.program.max_len_hint = 96
    before = eng.cache.all.clone()
    ref = eng.program.run_eager(2, Variant.GREEDY).logits.clone()
    eng.cache.all.copy_(before)
    out = _run(fused.mega_pieces(2, Variant.GREEDY, layers), False, layers)
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)


def test_more_programs_than_sms_need_the_drivers_word(tiny_llama, monkeypatch):
    """A persistent launch of more programs than SMs is refused before it starts unless the
    driver's occupancy count says they all fit (else the first grid barrier would spin forever);
    the count is looked up once per set of launch options."""
    from fgchat.engine.kernels import megakernel as mk

    eng, fused = _engine(tiny_llama)
    layers = DecodeLayers(fused.dec, eng.cache)
    assert layers.programs == layers.sm_count * mk.PROGRAMS_PER_SM
    layers.set_programs(2 * layers.sm_count)
    looked_up = []

    class Compiled:
        function = 1234
        metadata = type("M", (), {"shared": 100 * 1024})

        def _init_handles(self):
            pass

    monkeypatch.setattr(mk._decode_layers_kernel, "warmup", lambda *a, grid, **kw: Compiled())
    monkeypatch.setattr(mk, "max_resident_per_sm",
                        lambda function, threads, shared: looked_up.append((function, threads, shared)) or 1)
    ids = torch.tensor([5], device=DEV)
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot be resident"):
            layers.run(ids, torch.tensor([3], device=DEV), torch.tensor([0], device=DEV), persistent=True)
    assert looked_up == [(1234, layers.num_warps * 32, 100 * 1024)]


def test_occupancy_without_the_driver_is_zero():
    from fgchat.engine.kernels.megakernel import max_resident_per_sm

    assert max_resident_per_sm(0, 128, 0, library="libfgchat-no-such-driver.so.1") == 0


def test_set_tiles_sizes_the_statistics_for_their_column_width(tiny_llama):
    """A sweep's own tiles (sweep_mega.configure) with another column width than set_programs'
    get a statistics buffer of their own column-tile count."""
    import dataclasses

    eng, fused = _engine(tiny_llama)
    layers = DecodeLayers(fused.dec, eng.cache, programs=2)
    hidden = eng.cfg.hidden_size
    wide = dataclasses.replace(layers.tiles, bn=2 * layers.tiles.bn)
    layers.set_tiles(wide)
    assert layers.tiles == wide and layers.stats.shape[0] == -(-hidden // wide.bn)
    assert layers.np >= layers.stats.shape[0] and layers.np & (layers.np - 1) == 0
