"""Shared by the family models' GPU tests (test_gpu_qwen3_fused, test_gpu_gemma3_fused,
test_gpu_phi3_fused): random prompts, greedy runs of an engine in one mode, decode time per token,
and the checks every family runs: the fused path's engine line, the bf16 start-up check and modes
that agree, a preset's modes against the float32 reference beside its plain stages."""

from __future__ import annotations

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.startup_check import path_name
from fgchat.protocol.events import Mode, RequestFinished, SamplingParams
from fgchat.protocol.tuning import Tuning


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(eng: Engine, mode: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The greedy tokens of each prompt (`new` of them, no stop), all submitted together in `mode`."""
    eng.set_mode(mode)
    rids = [eng.submit(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts]
    done = {e.summary.request_id: e.summary.token_ids for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    return [done[r] for r in rids]


def tpot(eng: Engine, mode: str, prompt: list[int], batch: int) -> float:
    """Mean decode ms per token of `batch` requests of 128 tokens run together in `mode`."""
    run(eng, mode, [prompt[:32]] * batch, 16)  # warm: captures this batch's graphs
    rids = [eng.submit(prompt[:32], SamplingParams(max_tokens=128, ignore_eos=True)) for _ in range(batch)]
    done = [ev.summary for ev in eng.run_until_done() if isinstance(ev, RequestFinished)]
    return sum(s.tpot_ms for s in done if s.request_id in rids) / batch


def assert_modes_match_transformers(eng: Engine, model_dir, prompts: list[list[int]], new: int, label: str,
                                    modes: tuple[str, ...]) -> None:
    """Each mode's greedy tokens of every prompt alone and of all but the first together equal
    transformers' float32 ones (tiny_models.hf_greedy); prints which matched."""
    import tiny_models

    want = tiny_models.hf_greedy(model_dir, prompts, new)
    for mode in modes:
        alone = [run(eng, mode, [p], new)[0] for p in prompts]
        pair = run(eng, mode, prompts[1:], new)
        print(f"{label} {mode}: batch 1 equal {[a == w for a, w in zip(alone, want)]}, "
              f"batch 2 equal {[a == w for a, w in zip(pair, want[1:])]}")
        assert alone == want and pair == want[1:], mode


def print_step_times(eng: Engine, plain: Engine, modes: tuple[str, ...], prompt: list[int], label: str) -> None:
    """Each mode's decode ms per token at batch 1 and 8 of the fused engine beside the plain one."""
    for mode in modes:
        for batch in (1, 8):
            fused_ms, plain_ms = tpot(eng, mode, prompt, batch), tpot(plain, mode, prompt, batch)
            print(f"{label} {mode} batch {batch}: {fused_ms:.3f} ms/token fused, {plain_ms:.3f} plain "
                  f"({plain_ms / fused_ms:.2f}x)")


def assert_fused_line(eng: Engine, label: str, mega_reason: str, modes: tuple[str, ...]) -> None:
    """Prints the engine's path, notes and modes; the fused kernels serve it (no "plain torch
    stages" note), every one of `modes` is available and mega is not, for `mega_reason`."""
    info = eng.info()
    print(f"\n{label}: {path_name(eng)}; notes {info.notes}; modes {info.available_modes}")
    assert eng.decoder.fused
    assert not any("plain torch stages" in n for n in info.notes)
    assert mega_reason in info.available_modes["mega"]
    assert not any(info.available_modes[m] for m in modes), info.available_modes


def assert_startup_check_passes(eng: Engine, label: str) -> None:
    eng.run_startup_check()
    sc = eng.startup_check
    print(f"\n{label}: startup check {sc}")
    assert sc is not None and sc.passed, sc


def assert_modes_agree(eng: Engine, prompts: list[list[int]], new: int, modes: tuple[str, ...]) -> None:
    """Every mode gives the same greedy tokens of `prompts` run together."""
    tokens = [run(eng, m, prompts, new) for m in modes]
    assert all(t == tokens[0] for t in tokens[1:]), modes


def assert_preset_modes_match_the_reference(eng: Engine, prompt: list[int], modes: tuple[str, ...]) -> None:
    """Each mode's step against the float32 reference step (engine.modes) at `prompt`'s length,
    batch 1 and 2 (the second lane at half the length)."""
    half = prompt[:len(prompt) // 2]
    for mode in modes:
        for p in ([prompt], [prompt, half]):
            assert eng.modes._check_against_reference(Mode(mode), [x[-1] for x in p], [len(x) for x in p]), \
                (mode, len(p))


def plain_twin(preset: str) -> Engine:
    """The preset's engine on the plain family stages (bf16, the same random weights)."""
    plain = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048,
                                tuning=Tuning(fused=False)))
    assert not plain.decoder.fused and plain.decoder.family is not None
    return plain
