"""Qwen3, Gemma 3 and Phi-3 (model.families) on a GPU in every mode: the tiny Gemma 3 (its final
softcap) on the plain stages, Qwen3, Phi-3 and the gemma-3-1b preset on the fused ones (their own
checks: tests/gpu/test_gpu_{qwen3,gemma3,phi3}_fused.py).

- float32: greedy tokens of every mode (eager, piecewise, full) equal transformers' float32 on
  tiny random models (head dim 64, the Triton decode attention's), batch 1 and 2, Gemma 3 past
  its window of 8, Phi-3 below and past its LongRoPE original context;
- bf16: the start-up check and each mode's self-check against the float32 reference pass;
- the presets' random weights (qwen3-0.6b, gemma-3-1b (head dim 256), phi-4-mini) in every mode
  against the float32 reference; the engine's line names the plain stages for none; mega is
  unavailable.

Run: pytest -m gpu tests/gpu/test_gpu_families.py -s (prints what it measured)
"""

from __future__ import annotations

import pytest
import torch

import tiny_models
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import Mode, RequestFinished, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = ("eager", "piecewise", "full")
PROMPTS = {"qwen3": (5, 11, 19), "gemma3": (5, 13, 30), "phi3": (5, 7, 40)}
NEW = 24


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_families")
    return {f: tiny_models.build_model(root / f, f, hidden=256, layers=3, heads=4, kv_heads=2, head_dim=64,
                                       intermediate=512, seed=21 + i)
            for i, f in enumerate(tiny_models.NEW_FAMILIES)}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(eng: Engine, mode: str, prompts: list[list[int]]) -> list[list[int]]:
    eng.set_mode(mode)
    rids = [eng.submit(p, SamplingParams(max_tokens=NEW, ignore_eos=True)) for p in prompts]
    done = {e.summary.request_id: e.summary.token_ids for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    return [done[r] for r in rids]


@pytest.mark.parametrize("family", tiny_models.NEW_FAMILIES)
def test_float32_every_mode_matches_transformers(dirs, family):
    eng = Engine(EngineConfig(model=str(dirs[family]), device="cuda", dtype="float32", max_context=512))
    info = eng.info()
    print(f"\n{family}: notes {info.notes}; modes {info.available_modes}")
    assert any("plain torch stages" in n for n in info.notes) == (family == "gemma3")
    assert info.available_modes["mega"] and not any(info.available_modes[m] for m in MODES)
    prompts = [_prompt(n, 300 + n, eng.cfg.vocab_size) for n in PROMPTS[family]]
    want = tiny_models.hf_greedy(dirs[family], prompts, NEW)
    for mode in MODES:
        alone = [_run(eng, mode, [p])[0] for p in prompts]
        pair = _run(eng, mode, prompts[1:])
        same = [a == w for a, w in zip(alone, want)]
        print(f"{family} {mode}: batch 1 equal {same}, batch 2 equal {[a == w for a, w in zip(pair, want[1:])]}")
        assert alone == want and pair == want[1:], mode


@pytest.mark.parametrize("family", tiny_models.NEW_FAMILIES)
def test_bf16_modes_pass_the_float32_reference_checks(dirs, family):
    eng = Engine(EngineConfig(model=str(dirs[family]), device="cuda", dtype="bfloat16", max_context=512))
    eng.run_startup_check()
    sc = eng.startup_check
    info = eng.info()
    print(f"\n{family} bf16: startup check {sc}; modes {info.available_modes}")
    assert sc is not None and sc.passed, sc
    assert not any(info.available_modes[m] for m in MODES), info.available_modes
    prompts = [_prompt(n, 400 + n, eng.cfg.vocab_size) for n in PROMPTS[family]]
    tokens = {m: _run(eng, m, prompts) for m in MODES}
    assert tokens["eager"] == tokens["piecewise"] == tokens["full"]


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "gemma-3-1b", "phi-4-mini"])
def test_preset_random_weights_every_mode_against_the_reference(preset):
    """Each captured mode is checked against the float32 reference step at new lengths as it is
    captured (engine.modes); prompts of 600 tokens pass Gemma's 512 window."""
    eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048))
    eng.run_startup_check()
    info = eng.info()
    print(f"\n{preset}: startup check {eng.startup_check}; modes {info.available_modes}; notes {info.notes}")
    assert eng.startup_check.passed
    assert not any(info.available_modes[m] for m in MODES), info.available_modes
    assert not any("plain torch stages" in n for n in info.notes)
    prompt = _prompt(600, 5, eng.cfg.vocab_size)
    for mode in MODES:
        for p in ([prompt], [prompt, prompt[:300]]):
            assert eng.modes._check_against_reference(Mode(mode), [p[0][-1]] * len(p), [len(x) for x in p]), (mode, len(p))
