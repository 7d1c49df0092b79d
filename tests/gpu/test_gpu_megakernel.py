"""The mega kernel and the mega mode on a GPU: the persistent launch (grid barriers) against the
phase-by-phase launches, each decode step against the float32 reference, and the mode inside an
engine (self-check, many replays, batches).

Run on the H200 (skipped without CUDA): pytest -m gpu tests/gpu/test_gpu_megakernel.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import Mode, RequestFinished, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=["llama-3.2-1b", "smollm2-135m"])
def preset_engine(request):
    """The exact LM head: the float32-reference test compares every logit (the int8 pick's are
    approximate outside its candidates; tests/gpu/test_gpu_head_pick.py checks mega with the pick)."""
    from fgchat.protocol.tuning import Tuning

    return Engine(EngineConfig(preset=request.param, device="cuda", dtype="bfloat16", max_context=2048,
                               mode="full", tuning=Tuning(head_pick=False)))


@pytest.mark.parametrize("b", [1, 3, 8])
def test_persistent_launch_equals_phase_by_phase(preset_engine, b):
    """Same bits for the residual stream and every K/V row: the grid barriers order the phases as
    kernel boundaries do. Positions spread so attention splits are empty, partial and whole."""
    from fgchat.engine.kernels.megakernel import DecodeLayers

    eng = preset_engine
    layers = eng.modes.modes[Mode.MEGA].layers
    assert isinstance(layers, DecodeLayers)
    g = torch.Generator(device="cuda").manual_seed(b)
    eng.cache.all.copy_(torch.randn(eng.cache.all.shape, generator=g, device="cuda"))
    ids = torch.randint(0, eng.cfg.vocab_size, (b,), device="cuda")
    pos = torch.tensor([5, 1900, 0, 640, 64, 1, 1300, 127][:b], device="cuda")
    slots = torch.tensor([3, 0, 7, 1, 2, 4, 5, 6][:b], device="cuda")
    start = eng.cache.all.clone()
    h_step = layers.run(ids, pos, slots, persistent=False).clone()
    kv_step = eng.cache.all.clone()
    eng.cache.all.copy_(start)
    for _ in range(3):  # replays reuse the counters: each launch must leave them at zero
        h = layers.run(ids, pos, slots, persistent=True)
        assert int(layers.bar.item()) == 0 and int(layers.cnt.abs().sum()) == 0
    torch.cuda.synchronize()
    assert torch.isfinite(h).all()
    assert torch.equal(h, h_step)
    assert torch.equal(eng.cache.all, kv_step)


def test_every_step_close_to_float32_reference(preset_engine):
    """Greedy decode in mega mode; each step's logits against the float32 reference forward pass
    over the same tokens."""
    from reference_steps import greedy_steps_vs_reference

    eng = preset_engine
    prompt = [(13 * i + 5) % eng.cfg.vocab_size for i in range(300)]
    c = greedy_steps_vs_reference(eng, "mega", prompt, 16)
    assert eng.mode == Mode.MEGA  # the steps ran in mega, not in a fallback
    assert c.agrees(eng.dtype), c


def test_mega_mode_self_checks_and_serves_batches(preset_engine):
    """Every batch size captured with its self-check; eight requests of different lengths, greedy and
    sampled, finish with their token counts in mega mode; tokens follow full mode's where full's
    choice is clear (the same prompts in one run of each mode)."""
    eng = preset_engine
    eng.modes.self_check(Mode.MEGA)
    assert not eng.modes.unavailable.get(Mode.MEGA), eng.modes.unavailable
    v = eng.cfg.vocab_size
    prompts = [[(7 * j + 11 * i) % v for j in range(20 + 97 * i)] for i in range(8)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7 if i % 2 else 0.0, seed=i)
              for i in range(8)]
    out = {}
    for mode in ("full", "mega"):
        eng.set_mode(mode)
        rids = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
        done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        out[mode] = [done[r].token_ids for r in rids]
    assert all(len(t) == 24 for t in out["mega"])
    same_first = sum(a[0] == b[0] for a, b in zip(out["full"], out["mega"]))
    assert same_first >= 6, (out["full"], out["mega"])


def test_engine_captures_named_sizes_before_use():
    """Engine.capture_sizes (the bench calls it before timing a mode) captures mega at the named
    batch sizes only, with the self-check, so a timed round runs no capture."""
    eng = Engine(EngineConfig(preset="smollm2-135m", device="cuda", dtype="bfloat16", max_context=2048,
                              mode="full"))
    mega = eng.modes.modes[Mode.MEGA]
    assert not mega.has(3, False)
    eng.capture_sizes("mega", [3])
    assert mega.has(3, False) and not mega.has(2, False) and not eng.modes.unavailable.get(Mode.MEGA)
    eng.capture_sizes("eager", [1])  # nothing to capture: a no-op, not an error


def test_self_check_catches_rows_swapped():
    """The self-check can fail: a mega step whose rows come back swapped passes at batch size 1
    and disables the mode at batch size 2."""
    eng = Engine(EngineConfig(preset="smollm2-135m", device="cuda", dtype="bfloat16", max_context=2048,
                              mode="full"))
    layers = eng.modes.modes[Mode.MEGA].layers
    run = layers.run
    layers.run = lambda ids, pos, slots, persistent=True: run(ids, pos, slots, persistent).flip(0)
    eng.modes.self_check(Mode.MEGA)
    assert eng.modes.unavailable.get(Mode.MEGA) == "self-check mismatch at batch size 2"


def test_clock_stamps_leave_the_results_alone(preset_engine):
    """The timeline's stamps change no bit of the step, and each program's
    stamps are ordered: every phase ends after it starts and the next starts after it ends."""
    from fgchat.engine.kernels.megakernel import PHASES_PER_LAYER

    eng = preset_engine
    layers = eng.modes.modes[Mode.MEGA].layers
    ids = torch.tensor([5, 77, 901], device="cuda")
    pos = torch.tensor([40, 700, 3], device="cuda")
    slots = torch.tensor([0, 1, 2], device="cuda")
    start = eng.cache.all.clone()
    h = layers.run(ids, pos, slots).clone()
    eng.cache.all.copy_(start)
    n_phases = 1 + PHASES_PER_LAYER * eng.cfg.num_layers
    layers.stamps = torch.zeros((n_phases, layers.programs, 2, 2), dtype=torch.int64, device="cuda")
    try:
        h_stamped = layers.run(ids, pos, slots).clone()
        torch.cuda.synchronize()
        st = layers.stamps.cpu()
    finally:
        layers.stamps = None
    assert torch.equal(h, h_stamped)
    clk = st[..., 0]
    assert bool((clk[:, :, 1] >= clk[:, :, 0]).all()) and bool((clk[1:, :, 0] >= clk[:-1, :, 1]).all())
    assert bool((st[..., 1] > 0).all())  # every program stamped every phase
