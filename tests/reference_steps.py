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


def decode_keeping_logits(eng, mode: str, prompt: list[int], max_tokens: int = 16):
    """Greedy decode of `prompt` in `mode`: (the request's tokens, each decode step's logits row)."""
    from fgchat.protocol.events import RequestFinished, SamplingParams

    eng.set_mode(mode)
    eng.keep_logits, eng.step_logits = True, []
    rid = eng.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    events = []
    while eng.has_work():
        events += eng.step()
    eng.keep_logits = False
    tokens = {e.summary.request_id: e.summary for e in events if isinstance(e, RequestFinished)}[rid].token_ids
    return tokens, [t[0].float() for t in eng.step_logits]


def steps_agree_with_hf(ref, prompt: list[int], tokens: list[int], step_logits, label, ref_half=None) -> int:
    """Each decode step's logits against transformers `ref` (float32) on the same prefix: mean
    error within 4 bf16 ulps of the mean logit, or, given `ref_half` (the same model in the
    engine's dtype), within twice transformers' own error in that dtype at that step; and the
    greedy token the reference's argmax wherever its top two are more than 0.25 apart and, given
    `ref_half`, more than twice the largest error transformers' own logits have in that dtype at
    that step (moving two logits by that much each can swap them: random weights here put it at
    0.3-0.9 in bf16). Returns how many tokens that checked."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        want_all = ref(ids).logits[0].float()
        half_all = ref_half(ids).logits[0].float() if ref_half is not None else None
    checked = 0
    for i, logits in enumerate(step_logits):  # step i gave token i + 1
        want = want_all[len(prompt) + i]
        err, scale = (logits - want).abs().mean().item(), want.abs().mean().item()
        allowed, apart = 4 * 2**-7 * scale, 0.25
        if half_all is not None:
            half_err = (half_all[len(prompt) + i] - want).abs()
            allowed = max(allowed, 2 * half_err.mean().item())
            apart = max(apart, 2 * half_err.max().item())
        assert err <= allowed, (label, i, f"mean error {err:.4g}, allowed {allowed:.4g}, mean |logit| {scale:.4g}")
        top2 = want.topk(2)
        if (top2.values[0] - top2.values[1]).item() > apart:
            half_pick = int(half_all[len(prompt) + i].argmax()) if half_all is not None else None
            assert tokens[i + 1] == int(top2.indices[0]), (
                label, i, f"took {tokens[i + 1]} (logit {logits[tokens[i + 1]].item():.4g}, float32's "
                f"{want[tokens[i + 1]].item():.4g}); float32's top two {top2.indices.tolist()} at "
                f"{[round(v, 4) for v in top2.values.tolist()]}, ours there "
                f"{[round(logits[j].item(), 4) for j in top2.indices.tolist()]}; transformers in the "
                f"engine's dtype takes {half_pick}; mean error {err:.4g}, mean |logit| {scale:.4g}")
            checked += 1
    return checked
