"""The int8 LM-head pick (kernels.head_pick) on the GPU, in bf16 at the real heads' shapes: the
exact kernel's tokens, its logits bit for bit in the rescored tiles, inside a captured graph, and
an engine with the int8 head pick against a float32 transformers reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Llama-3.2-1B / SmolLM2-135M / Llama-3.1-8B heads (vocabulary, hidden)
HEADS = [(128256, 2048), (49152, 576), (128256, 4096)]


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    return x, w


@pytest.mark.parametrize("n,k", HEADS)
@pytest.mark.parametrize("m", [1, 8])
def test_pick_is_the_exact_heads_pick_at_real_shapes(n, k, m):
    from fgchat.engine.kernels import gemv, head_pick

    x, w = _inputs(m, n, k, n + k + m)
    head = head_pick.quantize(w)
    for pdl in (False, True):
        logits, tokens = head_pick.pick(x, w, head, pdl=pdl)
        exact, want = gemv.project_argmax(x, w, pdl=pdl)
        assert torch.equal(tokens, want), pdl
        bn = gemv.pick_config(n, k).block_n
        for r in range(m):  # the winning tile came back with the exact kernel's bits
            t = int(tokens[r]) // bn
            assert torch.equal(logits[r, t * bn:(t + 1) * bn], exact[r, t * bn:(t + 1) * bn])
        bound = x.float().norm(dim=1)[:, None] * head.slack[None, :]
        assert ((logits - exact).abs() <= bound).all()
        rescored = (logits == exact).view(m, -1, bn).all(dim=2).all(dim=0)
        flagged, unsure = _flagged_tiles(x, head, bn)
        assert torch.equal(rescored | unsure, flagged | unsure)  # pass 2 recomputed what the bound left open


def _flagged_tiles(x: torch.Tensor, head, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head tile, from float64 approximations on the host side: whether any row's upper bound
    in it reaches that row's largest lower bound, and whether that is too close to call."""
    a = (x.double() @ head.q.double().T) * head.scale.double()
    beta = x.double().norm(dim=1)[:, None] * head.slack.double()[None, :]
    m = x.shape[0]
    lo, hi = ((a - beta).view(m, -1, bn).amax(dim=2), (a + beta).view(m, -1, bn).amax(dim=2))
    top = lo.amax(dim=1, keepdim=True)
    eps = 1e-4 * (top.abs() + 1)
    return (hi >= top).any(dim=0), ((hi - top).abs() <= eps).any(dim=0)


def test_sampled_pick_is_the_exact_heads_sample():
    from fgchat.engine.kernels import gemv, head_pick

    n, k, m = 128256, 2048, 8
    x, w = _inputs(m, n, k, 5)
    x = x * 0.3  # logits of a few units: the noise matters
    head = head_pick.quantize(w)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.05, 0.7, 1.0, 2.0], device="cuda")
    seeds = torch.tensor([3, 2**40 + 1, 7, 9, 11, 13, 15, 17], device="cuda")
    for step in range(4):
        positions = torch.arange(m, device="cuda") * 5 + step
        got = head_pick.pick(x, w, head, pdl=True, sample=(temps, seeds, positions))[1]
        want = gemv.project_argmax(x, w, pdl=True, sample=(temps, seeds, positions))[1]
        assert torch.equal(got, want), step


def test_pick_replays_in_a_graph_with_new_rows():
    from fgchat.engine.kernels import gemv, head_pick

    n, k, m = 128256, 2048, 4
    x, w = _inputs(m, n, k, 7)
    head = head_pick.quantize(w)
    out = {}
    head_pick.pick(x, w, head, pdl=True)  # compiled outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out["logits"], out["tokens"] = head_pick.pick(x, w, head, pdl=True)
    for seed in range(3):
        x.copy_(torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        g.replay()
        assert torch.equal(out["tokens"], gemv.project_argmax(x, w)[1]), seed


def test_engine_with_the_int8_head_matches_a_float32_reference(tmp_path):
    """Greedy tokens of every mode with the int8 head pick equal those with the exact head, and each
    is the float32 reference's argmax wherever its top two are apart. The pick's logits are
    approximate outside rescored tiles: each step's maximum is still its token, with the exact
    head's bits, and the exact head's logits stay close to the reference."""
    transformers = pytest.importorskip("transformers")
    import tiny_models
    from reference_steps import decode_keeping_logits, steps_agree_with_hf

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    model = tiny_models.build_model(tmp_path / "m", "llama", hidden=1024, layers=2, heads=16, kv_heads=4,
                                    head_dim=64, intermediate=4096, max_pos=2048, seed=5)
    engines = {int8: Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=1024,
                                         mode="full", tuning=Tuning(head_pick=int8))) for int8 in (False, True)}
    assert engines[True].decoder.fused_stages.head_int8 is not None
    assert engines[True].startup_check is None or engines[True].startup_check.passed
    ref, ref_half = (transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dt).cuda().eval()
                     for dt in (torch.float32, torch.bfloat16))
    prompt = torch.randint(3, engines[True].cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(2)).tolist()

    modes = engines[True].info().available_modes
    assert all(modes.get(m) == "" for m in ("eager", "piecewise", "full")), engines[True].info().notes
    for mode in [m for m in ("eager", "piecewise", "full", "mega") if modes.get(m) == ""]:
        tokens, steps = decode_keeping_logits(engines[True], mode, prompt)
        exact_tokens, exact_steps = decode_keeping_logits(engines[False], mode, prompt)
        assert tokens == exact_tokens, mode
        for i, (approx, exact) in enumerate(zip(steps, exact_steps)):  # step i gave token i + 1
            assert int(approx.argmax()) == tokens[i + 1], (mode, i)  # approximations stay below the pick
            assert approx[tokens[i + 1]] == exact[tokens[i + 1]], (mode, i)  # its tile rescored exactly
        assert steps_agree_with_hf(ref, prompt, tokens, exact_steps, mode, ref_half) >= 4, mode


def test_default_pick_on_1b_gives_the_exact_heads_tokens_in_every_mode():
    """Llama-3.2-1B's shape (random weights: near ties everywhere), the pick left to its default
    (one row, a 525 MB head): greedy and sampled tokens of every mode equal the exact head's,
    batch 1 through the pick and batch 3 through the exact head alike."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams
    from fgchat.protocol.tuning import Tuning

    engines = {on: Engine(EngineConfig(preset="llama-3.2-1b", device="cuda", dtype="bfloat16", max_context=1024,
                                       mode="full", tuning=Tuning(head_pick=None if on else False)))
               for on in (True, False)}
    assert engines[True].decoder.fused_stages.head_int8 is not None
    assert engines[False].decoder.fused_stages.head_int8 is None
    v = engines[True].cfg.vocab_size
    prompts = [[(31 * j + 7 * i) % v for j in range(40 + 50 * i)] for i in range(3)]
    modes = engines[True].info().available_modes
    for mode in [m for m in ("eager", "piecewise", "full", "mega") if modes.get(m) == ""]:
        for group in ([prompts[0]], prompts):
            out = {}
            for on, eng in engines.items():
                eng.set_mode(mode)
                rids = [eng.submit(p, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7 * (i % 2), seed=i))
                        for i, p in enumerate(group)]
                done = {e.summary.request_id: e.summary.token_ids for e in eng.run_until_done()
                        if isinstance(e, RequestFinished)}
                out[on] = [done[r] for r in rids]
            assert out[True] == out[False], (mode, len(group))


def test_greedy_prefill_takes_the_pick_with_the_exact_heads_argmax(tmp_path):
    """A greedy prompt's last logits from the int8 pick, through a prefill graph (full) and
    eagerly, against the exact head's (the same argmax, the same bits there) and a float32
    reference of the same weights (the same argmax where its top two are apart)."""
    transformers = pytest.importorskip("transformers")
    import tiny_models

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    model = tiny_models.build_model(tmp_path / "m", "llama", hidden=1024, layers=2, heads=16, kv_heads=4,
                                    head_dim=64, intermediate=4096, max_pos=2048, seed=6)
    eng = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_context=1024, mode="full",
                              tuning=Tuning(head_pick=True)))
    assert eng.decoder.fused_stages.head_int8 is not None and eng.modes.prefill_graphs is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(8)
    apart = 0
    for t in (9, 100, 300):
        ids = torch.randint(3, eng.cfg.vocab_size, (t,), generator=g).cuda()
        with torch.no_grad():
            want = ref(ids[None]).logits[0, -1].float()
        for mode in ("full", "eager"):
            eng.set_mode(mode)
            exact = eng.modes.prefill_logits(eng.mode, ids, 0).clone()
            picked = eng.modes.prefill_logits(eng.mode, ids, 0, greedy=True)
            top = int(exact.argmax())
            assert int(picked.argmax()) == top and picked[top] == exact[top], (t, mode)
            assert not torch.equal(picked, exact), (t, mode)  # the pick ran: approximations elsewhere
            two = want.topk(2).values
            if float(two[0] - two[1]) > 0.05 * float(want.abs().max()):
                apart += 1
                assert top == int(want.argmax()), (t, mode)
    assert apart >= 2
