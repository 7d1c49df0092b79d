"""The start-up check: the production path against a float32 plain-torch reference, on the
weights the user loaded.

One short prompt runs through the engine exactly as a request would (prefill in the current mode,
a prefill graph in full mode, then one decode step in the current mode) and through
`model.reference.reference_logits` (plain torch ops, float32 throughout). The logits of the last
prompt position and of the decode step are compared: finite, largest relative error, top-1 and
top-5 overlap. A near tie in the reference (its top two within the dtype's noise) lets top-1 differ.

Why: the modes are checked against each other elsewhere, but all modes share the same kernels, so a
kernel that is wrong on this model's activations (massive activation channels, say) would pass
that check. This one compares with arithmetic that shares nothing with the fast path.

The decode step's own pick must be the first maximum of its logits. Where greedy steps pick from a
low-precision copy of the LM head (Tuning.head_pick) their logits are exact only for the rescored
candidates, so the same step runs again eagerly with the exact head for the logits compared.

Invariants: the check runs before any request is admitted and uses cache slot 0 only (a later
prefill overwrites it); it reads the device only at the end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fgchat.protocol.events import Mode, StartupCheck
from fgchat.engine.model.reference import reference_logits

if TYPE_CHECKING:
    from fgchat.engine.core import Engine

CHECK_MESSAGE = "Hi! In one sentence, what can you do?"
# Largest relative error of the logits (L2 norm) that still agrees, per dtype. Real bf16 weights
# measured 0.5-6% against float32 (SmolLM2-135M, 8 prompts); a wrong kernel gives tens of percent.
MAX_REL_ERR = {torch.float32: 0.01, torch.float16: 0.12, torch.bfloat16: 0.12}
MIN_TOP5_OVERLAP = 3
# Fault injection for tests: FGCHAT_FAULT=startup-check perturbs the first checked path's logits;
# FGCHAT_FAULT=slow-steps makes every engine step 5 ms longer (Engine.step).
FAULT_ENV = "FGCHAT_FAULT"


@dataclass(frozen=True)
class Comparison:
    finite: bool
    max_rel_err: float
    top1_equal: bool
    top1_ok: bool  # equal, or within the reference's near-tie band
    top5_overlap: int  # the smallest over the compared positions
    top1: tuple[int, int]  # (production, reference) at the worst position

    def agrees(self, dtype: torch.dtype) -> bool:
        return (self.finite and self.max_rel_err <= MAX_REL_ERR.get(dtype, 0.12) and self.top1_ok
                and self.top5_overlap >= MIN_TOP5_OVERLAP)


def compare(prod: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Comparison:
    """prod, ref: float32 logits [P, V] of the same positions."""
    prod, ref = prod.float(), ref.float()
    finite = bool(torch.isfinite(prod).all())
    rel = ((prod - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30))
    worst = int(rel.argmax())
    p1, r1 = prod.argmax(-1), ref.argmax(-1)
    rmax = ref.max(-1).values
    band = MAX_REL_ERR.get(dtype, 0.12) * rmax.abs().clamp_min(1.0) / 4
    picked = ref.gather(-1, p1[:, None])[:, 0]
    top1_ok = bool(((p1 == r1) | (picked >= rmax - band)).all())
    overlap = min(len(set(a.tolist()) & set(b.tolist()))
                  for a, b in zip(prod.topk(5, dim=-1).indices, ref.topk(5, dim=-1).indices))
    return Comparison(finite, float(rel.max()) if finite else float("inf"), bool((p1 == r1).all()),
                      top1_ok, overlap, (int(p1[worst]), int(r1[worst])))


def check_prompt(engine: Engine) -> list[int]:
    """A short fixed prompt: the chat template of CHECK_MESSAGE, or fixed ids without a tokenizer."""
    tok = engine.tokenizer
    if tok is not None:
        try:
            ids = list(tok.apply_chat_template([{"role": "user", "content": CHECK_MESSAGE}]))
            if 2 <= len(ids) < min(64, engine.max_context - 1):
                return ids
        except Exception:  # a template that needs other roles: fall back to fixed ids
            pass
    vocab = engine.cfg.vocab_size
    return [(7 * i + 3) % vocab for i in range(min(16, engine.max_context - 2))]


@torch.inference_mode()
def production_logits(engine: Engine, ids: list[int], nxt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([2, V], [1]): the last prompt position's logits and those of one decode step of `nxt`,
    both as a request in the engine's current mode would get them, and the token that step picked."""
    dev = engine.device
    first = engine.modes.prefill_logits(engine.mode, torch.tensor(ids, dtype=torch.int64, device=dev), 0)
    first = first.float().clone()
    engine.bufs.stage([nxt], [len(ids)], [0], [0.0], [1.0], [0], [0])
    engine.program.max_len_hint = len(ids) + 1
    if engine.mode == Mode.EAGER:  # the kernels a recorded launch list replays, without recording one
        out = engine.program.run_eager(1, False)
    else:
        out, _ = engine.modes.run(engine.mode, 1, False)
    picked, last = out.tokens[:1].clone(), out.logits[0].float().clone()
    if engine.decoder.picks_approximately:
        # exact logits: the same step again (it rewrites the same K/V), eagerly, with the exact head
        with engine.decoder.exact_head():
            last = engine.program.run_eager(1, False).logits[0].float().clone()
    engine.program.max_len_hint = None
    return torch.stack([first, last]), picked


def path_name(engine: Engine) -> str:
    kernels = "fused Triton kernels" if engine.decoder.fused else "plain torch ops"
    where = f"{engine.mode} mode" if engine.mode != Mode.EAGER else "eager"
    return f"{kernels}, {where}, {engine.dtype_name}"


def run(engine: Engine) -> StartupCheck:
    """Check the engine's production path; on a mismatch of the fused kernels, switch the engine
    to plain torch ops (Engine.use_plain_path) and check that. Returns what was found."""
    t0 = time.perf_counter()
    ids = check_prompt(engine)
    dec = engine.decoder
    ref = reference_logits(engine.cfg, dec.w, torch.tensor(ids + [ids[-1]], device=engine.device),
                           dec.cos, dec.sin, dec.scale)[-2:]
    fault = os.environ.get(FAULT_ENV, "") == "startup-check"
    path = path_name(engine)
    cmp = _compare_path(engine, ids, ref, fault)
    if cmp.agrees(engine.dtype):
        return _result(True, path, cmp, t0)
    first_cmp, what = cmp, _describe(cmp)
    if engine.decoder.fused:
        engine.use_plain_path()
        cmp = _compare_path(engine, ids, ref, False)
        if cmp.agrees(engine.dtype):
            msg = (f"startup check: {path} disagree with a float32 reference on these weights ({what}); "
                   f"running plain torch ops instead (as FGCHAT_FUSED=0)")
            return _result(False, path, first_cmp, t0, "plain torch ops", msg)
        msg = (f"startup check: {path} and plain torch ops disagree with a float32 reference on these "
               f"weights ({_describe(cmp)}); running plain torch ops; try --dtype float32")
        return _result(False, path, first_cmp, t0, "plain torch ops (also disagrees)", msg)
    hint = "output may be wrong" if engine.dtype == torch.float32 else "try --dtype float32"
    msg = (f"startup check: {path} disagrees with a float32 reference on these weights ({what}); "
           f"no other path to fall back to; {hint}")
    return _result(False, path, first_cmp, t0, None, msg)


def _compare_path(engine: Engine, ids: list[int], ref: torch.Tensor, fault: bool) -> Comparison:
    prod, picked = production_logits(engine, ids, ids[-1])
    if fault:  # a wrong kernel, as far as the logits can tell
        prod = prod.roll(1, dims=-1) * 0.5
    prod, picked = prod.cpu(), int(picked.cpu()[0])
    cmp = compare(prod, ref.cpu(), engine.dtype)
    if not fault and picked != int(prod[1].argmax()):  # the step picked other than its logits' maximum
        cmp = dataclasses.replace(cmp, top1_equal=False, top1_ok=False,
                                  top1=(picked, int(ref[1].argmax())))
    return cmp


def _describe(c: Comparison) -> str:
    err = f"max relative error {c.max_rel_err:.3f}" if c.finite else "non-finite logits"
    return f"{err}, top-1 {c.top1[0]} vs {c.top1[1]}, top-5 overlap {c.top5_overlap}/5"


def _result(passed: bool, path: str, c: Comparison, t0: float, fallback: str | None = None,
            message: str = "") -> StartupCheck:
    return StartupCheck(passed, path, c.top1_equal, c.top5_overlap, c.max_rel_err,
                        time.perf_counter() - t0, fallback, message)
