"""The int8 LM-head pick (kernels.head_pick; Triton's interpreter on CPU, fp16 because the
interpreter's dot takes no bf16) against the exact LM head kernel and float64 arithmetic.

The GPU runs of the same kernels at the real heads' shapes, in bf16, are tests/gpu/test_gpu_head_pick.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton loads and kernels are decorated
pytest.importorskip("triton")

from fgchat.engine.kernels import gemv, head_pick  # noqa: E402
from fgchat.engine.kernels.gemv import ProjConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = ProjConfig(64, 64, 4, 4)


def _head(n: int, k: int, seed: int, spread: float = 1.0):
    """A head whose rows vary in scale and carry a few large entries (what per-row int8 meets)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    w *= torch.rand(n, 1, generator=g) * spread + 0.5
    w[torch.randint(0, n, (n // 10,), generator=g), torch.randint(0, k, (n // 10,), generator=g)] *= 8
    return w.half().to(DEV)


def _rows(m: int, k: int, seed: int, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).half().to(DEV)


def _bound(x: torch.Tensor, head: head_pick.Int8Head) -> torch.Tensor:
    return x.double().norm(dim=1)[:, None] * head.slack.double()[None, :]


def test_quantize_bounds_every_row():
    w = _head(300, 128, 1)
    head = head_pick.quantize(w)
    deq = head.scale.double()[:, None] * head.q.double()
    assert head.q.dtype == torch.int8 and int(head.q.abs().max()) == 127
    assert ((w.double() - deq).norm(dim=1) <= head.slack.double()).all()


@pytest.mark.parametrize("m,n", [(1, 704), (3, 640), (8, 1024)])
def test_greedy_pick_is_the_exact_kernels_pick(m, n):
    w = _head(n, 128, m + n)
    head = head_pick.quantize(w)
    x = _rows(m, 128, n)
    logits, tokens = head_pick.pick(x, w, head, CFG)
    exact, want = gemv.project_argmax(x, w, CFG)
    assert torch.equal(tokens, want)
    # approximations within the bound everywhere, exact where a tile was rescored
    assert ((logits.double() - exact.double()).abs() <= _bound(x, head)).all()
    same = (logits == exact).view(m, -1, CFG.block_n).all(dim=2).any(dim=0)  # per tile
    assert same[tokens // CFG.block_n].all()
    assert int(same.sum()) < same.numel() // 2  # most tiles never read at full precision


def test_near_ties_and_exact_ties_go_to_the_first_index():
    n, k = 512, 128
    w = _head(n, k, 5)
    x = _rows(2, k, 6)
    w[300] = w[40]  # exact duplicates of the row 0 maximum below: the first index wins
    w[450] = w[40]
    x[0] = (w[40].float() * 40).half()  # row 0: row 40 is the clear maximum, with its duplicates
    w[201] = (w[200].float() * 1.001).half()  # row 1: near ties inside one int8 bound
    x[1] = (w[200].float() * 40).half()
    head = head_pick.quantize(w)
    _, tokens = head_pick.pick(x, w, head, CFG)
    exact, want = gemv.project_argmax(x, w, CFG)
    assert torch.equal(tokens, want) and int(tokens[0]) == 40
    assert torch.equal(tokens, exact.argmax(dim=1))


def test_many_candidates_are_still_exact():
    """Every row equally likely (a zero input row, and a head of one repeated row): every tile is
    rescored, the pick is still the first maximum."""
    n, k = 384, 64
    w = _head(n, k, 9)
    w[:] = w[7]
    x = _rows(2, k, 10)
    x[1] = 0
    head = head_pick.quantize(w)
    logits, tokens = head_pick.pick(x, w, head, CFG)
    exact, want = gemv.project_argmax(x, w, CFG)
    assert torch.equal(tokens, want) and tokens.tolist() == [0, 0]
    assert torch.equal(logits, exact)


@pytest.mark.parametrize("m", [1, 5])
def test_sampled_pick_is_the_exact_kernels_sample(m):
    n, k = 640, 128
    w = _head(n, k, 20 + m)
    head = head_pick.quantize(w)
    x = _rows(m, k, 21, scale=1.0)  # logits of a few units: the noise decides too
    temps = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.05][:m], device=DEV)
    seeds = torch.tensor([3, 2**40 + 1, 7, 9, 11][:m], device=DEV)
    picks = set()
    for step in range(5):
        positions = torch.arange(m, device=DEV) * 5 + step
        _, tokens = head_pick.pick(x, w, head, CFG, sample=(temps, seeds, positions))
        _, want = gemv.project_argmax(x, w, CFG, sample=(temps, seeds, positions))
        assert torch.equal(tokens, want), (step, tokens, want)
        picks.add(int(tokens[min(2, m - 1)]))  # T 1
    assert len(picks) > 1 or m == 1  # a T > 0 row moves with the position


def test_rows_do_not_depend_on_the_batch():
    n, k = 640, 128
    w = _head(n, k, 30)
    head = head_pick.quantize(w)
    x = _rows(6, k, 31)
    _, all_rows = head_pick.pick(x, w, head, CFG)
    for r in range(6):
        assert int(head_pick.pick(x[r: r + 1].contiguous(), w, head, CFG)[1][0]) == int(all_rows[r])


def test_ragged_vocabulary_and_k_tail():
    """V not a multiple of the tile, K a multiple of 64 but not of the exact tile's 128."""
    n, k = 333, 192
    w = _head(n, k, 40)
    head = head_pick.quantize(w)
    x = _rows(4, k, 41)
    cfg = ProjConfig(64, 128, 4, 4)
    logits, tokens = head_pick.pick(x, w, head, cfg)
    exact, want = gemv.project_argmax(x, w, cfg)
    assert torch.equal(tokens, want)
    assert ((logits.double() - exact.double()).abs() <= _bound(x, head)).all()


def test_rejects_what_it_cannot_pick():
    w = _head(128, 128, 50)
    head = head_pick.quantize(w)
    with pytest.raises(ValueError, match="at most"):
        head_pick.pick(_rows(17, 128, 1), w, head, CFG)
    with pytest.raises(ValueError, match="w's dtype"):
        head_pick.pick(_rows(1, 128, 1).float(), w, head, CFG)
    assert not head_pick.supports(w.float()) and not head_pick.supports(w[:, :100])
    with pytest.raises(ValueError, match="K % 64"):
        head_pick.quantize(w[:, :100].contiguous())


def test_fused_step_with_the_int8_head_picks_the_exact_heads_tokens(tiny_model_dirs):
    """A fused decoder (fp16) with the int8 pick's head against the same decoder with the exact
    head: same greedy and sampled tokens, logits within the bound, exact ones inside exact_head()."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram, Variant
    from fgchat.protocol.tuning import Tuning

    eng = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), device="cpu", max_context=64,
                              dtype="float16"))
    progs = {}
    for int8 in (False, True):
        dec = Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True, tuning=Tuning(head_pick=int8))
        progs[int8] = StepProgram(dec, eng.cache, eng.bufs, eng.attention)
    stages = progs[True].dec.fused_stages
    assert stages.head_int8 is not None and progs[False].dec.fused_stages.head_int8 is None
    g = torch.Generator().manual_seed(3)
    for t in eng.cache.k + eng.cache.v:
        t.copy_(torch.randn(t.shape, generator=g).half())
    b = 3
    for variant, temps in ((Variant.GREEDY, [0.0] * b), (Variant.SAMPLED, [0.0, 0.8, 1.3])):
        eng.bufs.stage([5, 77, 300], [9, 20, 30], [4, 0, 7], temps, [1.0] * b, [0] * b, [11, 12, 13])
        for p in progs.values():
            p.max_len_hint = 31
        want = progs[False].run_eager(b, variant)
        want_tokens, want_logits = want.tokens.clone(), want.logits.clone()
        got = progs[True].run_eager(b, variant)
        assert torch.equal(got.tokens, want_tokens), variant
        assert not torch.equal(got.logits, want_logits)  # approximations outside rescored tiles
        assert (got.logits - want_logits).abs().max() < 1.0
        with stages.exact_head():
            assert torch.equal(progs[True].run_eager(b, variant).logits, want_logits)


def test_default_pick_only_where_it_pays(tiny_model_dirs, monkeypatch):
    """Left to its default on CUDA, the pick copies only heads of PAYS_BYTES and up and picks
    only batches of PAYS_ROWS; head_pick=True picks every batch of any head."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.step import StepProgram, Variant
    from fgchat.protocol.tuning import Tuning

    assert head_pick.pays(torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta"))
    assert not head_pick.pays(torch.empty(49152, 576, dtype=torch.bfloat16, device="meta"))
    assert not head_pick.pays(torch.empty(128256, 2048, dtype=torch.float32, device="meta"))
    eng = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), device="cpu", max_context=64,
                              dtype="float16"))
    small = Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True, tuning=Tuning(head_pick=None))
    assert small.fused_stages.head_int8 is None  # too small a head to pay for its copy
    monkeypatch.setattr(head_pick, "PAYS_BYTES", 0)
    dec = Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True, tuning=Tuning(head_pick=None))
    assert dec.fused_stages.head_int8 is not None and dec.fused_stages.head_pick_rows == head_pick.PAYS_ROWS
    prog = StepProgram(dec, eng.cache, eng.bufs, eng.attention)
    calls = []
    real_pick = head_pick.pick
    monkeypatch.setattr(head_pick, "pick", lambda x, *a, **kw: calls.append(x.shape[0]) or real_pick(x, *a, **kw))
    for b in (1, 3):
        eng.bufs.stage([5, 77, 300][:b], [9, 20, 30][:b], [4, 0, 7][:b], [0.0] * b, [1.0] * b, [0] * b, [0] * b)
        prog.max_len_hint = 31
        prog.run_eager(b, Variant.GREEDY)
    assert calls == [1]  # three rows went to the exact head
    forced = Decoder(eng.cfg, eng.model.weights, eng.max_context, fused=True, tuning=Tuning(head_pick=True))
    assert forced.fused_stages.head_pick_rows == gemv.MAX_ROWS


@pytest.fixture
def int8_engine(tiny_model_dirs):
    """A CPU engine (fp16) rebuilt on the fused stages with the int8 head pick forced, eager
    (Triton's interpreter runs the kernels)."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    eng = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), device="cpu", max_context=64,
                              dtype="float16", lazy_capture=True, tuning=Tuning(head_pick=True)))
    eng._build(True)
    assert eng.decoder.fused_stages.head_int8 is not None
    return eng


def test_startup_check_passes_the_int8_pick_and_catches_a_wrong_one(int8_engine, monkeypatch):
    from fgchat.engine import startup_check

    eng = int8_engine
    ok = startup_check.run(eng)
    assert ok.passed and ok.fallback is None, ok
    good_pick = head_pick.pick

    def off_by_one(*args, **kwargs):
        logits, tokens = good_pick(*args, **kwargs)
        return logits, (tokens + 1) % logits.shape[1]

    monkeypatch.setattr(head_pick, "pick", off_by_one)
    bad = startup_check.run(eng)
    assert not bad.passed and bad.fallback == "plain torch ops" and not eng.decoder.fused


@pytest.mark.parametrize("tile", [(64, 4, 2, False), (128, 4, 4, True), (512, 8, 3, False)])
def test_pass_one_tiles_change_no_pick(tile, monkeypatch):
    """Other pass-1 tiles (K width, swapped operands; 512 halves to K's 128): the same picks, the
    approximations still within the bound."""
    monkeypatch.setattr(head_pick, "APPROX_TILE", tile)
    w = _head(640, 128, 60)
    head = head_pick.quantize(w)
    x = _rows(5, 128, 61)
    logits, tokens = head_pick.pick(x, w, head, CFG)
    exact, want = gemv.project_argmax(x, w, CFG)
    assert torch.equal(tokens, want)
    assert ((logits.double() - exact.double()).abs() <= _bound(x, head)).all()


def test_a_greedy_prompts_first_token_comes_from_the_pick(int8_engine, monkeypatch):
    """A prompt whose requests are all greedy and unpenalized has its last logits from the int8
    pick (the exact head's argmax, the others within the bound); a sampled or penalized request's
    prompt gets the exact head's. (On CPU the exact head is torch's product, the pick rescores
    with the LM head kernel's sums: the same logit to rounding; on CUDA the same bits,
    tests/gpu/test_gpu_head_pick.py.)"""
    from fgchat.protocol.events import RequestFinished, SamplingParams

    eng = int8_engine
    calls = []
    real_pick = head_pick.pick
    monkeypatch.setattr(head_pick, "pick", lambda x, *a, **kw: calls.append(x.shape[0]) or real_pick(x, *a, **kw))
    g = torch.Generator().manual_seed(4)
    for t in (7, 19, 33):
        ids = torch.randint(3, eng.cfg.vocab_size, (t,), generator=g)
        exact = eng.modes.prefill_logits(eng.mode, ids, 1)
        assert not calls
        picked = eng.modes.prefill_logits(eng.mode, ids, 1, greedy=True)
        assert calls == [1]
        calls.clear()
        top = int(exact.argmax())
        assert int(picked.argmax()) == top, t
        torch.testing.assert_close(picked[top], exact[top], rtol=1e-3, atol=1e-3)
        assert not torch.equal(picked, exact) and (picked - exact).abs().max() < 1.0, t
    prompt = torch.randint(3, eng.cfg.vocab_size, (21,), generator=g).tolist()
    for params, picks in ((SamplingParams(max_tokens=1), 1), (SamplingParams(max_tokens=1, temperature=0.8), 0),
                          (SamplingParams(max_tokens=1, repetition_penalty=1.2), 0)):
        calls.clear()
        eng.submit(prompt, params)
        done = [e for e in eng.run_until_done() if isinstance(e, RequestFinished)]
        assert len(done) == 1 and len(done[0].summary.token_ids) == 1 and len(calls) == picks, params
