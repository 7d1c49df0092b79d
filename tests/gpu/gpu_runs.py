"""Shared by the family models' GPU tests (test_gpu_qwen3_fused, test_gpu_gemma3_fused): random
prompts and greedy runs of an engine in one mode."""

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
