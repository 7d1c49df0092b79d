"""Each greedy decode step of an engine against the float32 reference forward pass (GPU tests)."""

from __future__ import annotations

import torch


def greedy_steps_vs_reference(eng, mode: str, prompt: list[int], max_tokens: int):
    """Greedy decode of `prompt` in `mode`; every decode step's logits against the float32 reference
    over the same tokens (prefix-consistent, so the production path's own choices are followed).
    Returns the start-up check's Comparison."""
    from fgchat.engine.model.reference import reference_logits
    from fgchat.engine.startup_check import compare
    from fgchat.protocol.events import SamplingParams, TokenEvent

    eng.set_mode(mode)
    eng.keep_logits = True
    eng.step_logits.clear()
    eng.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    toks = [e.token_id for e in eng.run_until_done() if isinstance(e, TokenEvent)]
    eng.keep_logits = False
    steps = torch.stack([lg[0].float() for lg in eng.step_logits])  # decode steps 1..max_tokens-1
    dec = eng.decoder
    ref = reference_logits(eng.cfg, dec.w, torch.tensor(prompt + toks[:-1], device=eng.device), dec.cos,
                           dec.sin, dec.scale)[len(prompt):]
    return compare(steps.cpu(), ref.cpu(), eng.dtype)
