"""Shared by the family models' GPU tests (test_gpu_qwen3_fused, test_gpu_gemma3_fused,
test_gpu_phi3_fused): random prompts, greedy runs of an engine in one mode, decode time per token."""

from __future__ import annotations

import torch

from fgchat.engine.core import Engine
from fgchat.protocol.events import RequestFinished, SamplingParams


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
