"""Greedy picks of the CPU LM head from a packed bf16 copy, the candidates rescored in float32.

The exact CPU head (ops.CpuHead) reads a float32 copy of the head every step (SmolLM2-135M: 113 MB,
~3.6 ms of a ~26 ms bf16 step on 2 vCPUs). A greedy pick needs only each row's maximum: oneDNN's
packed bf16 product reads half the bytes and more than twice as fast (1.1 ms), but its logits are
rounded to bf16. Per row the error of an approximate logit a_v is bounded:
    |x . w_v - a_v| <= 2^-7 |a_v| + ||x|| e_v + ||x - x~|| n_v
(bf16 rounding of the float32 sum with room; e_v = ||w_v - w~_v|| + float32 accumulation of either
product; n_v = ||w~_v||; w~, x~: the bf16 copies, x~ = x for bf16 rows). With beta the largest
bound of the row (its largest |a| and the largest e and n), every v whose exact logit can be the
row's maximum has a_v >= max(a) - 2 beta; those candidates are recomputed from the weights (float64
sums of the exact products) and the first maximum among them is the pick.

Invariants:
- The token is the first maximum of x . w_v over the head's own weights, summed in float64 (CpuHead's
  float32 sums differ by ~1e-6 of the logits: only such near-ties could pick otherwise).
- Logits out: those sums (rounded to float32) for the candidates, bf16-rounded approximations elsewhere.
- Used only where the CPU computes bf16 natively, the copy fits a 1 / PACK_RAM_SHARE share of
  physical memory (as cpu_linear's packed projections), and oneDNN's packed bf16 product was
  checked against F.linear at preparation; else the decoder keeps CpuHead for every step.
"""

from __future__ import annotations

import torch

from fgchat.engine.model.cpu_linear import PACK_RAM_SHARE, agrees, pack, packed_linear, physical_memory_bytes

ROUNDING = 2.0**-7  # twice bf16's unit roundoff, relative to |a|


class CpuHeadPick:
    """The greedy pick of a [V, K] head on CPU: `pick(x)` -> (float32 logits [M, V], int64 tokens [M])."""

    def __init__(self, w: torch.Tensor, wb: torch.Tensor, packed: torch.Tensor, rows: int = 8192) -> None:
        """w: the head; wb: its bf16 copy; packed: wb packed for oneDNN."""
        self.w = w
        self.packed = packed
        gamma = (w.shape[1] + 16) * 2.0**-22  # 4x the float32 accumulation bound K * 2^-24
        max_err = max_norm = 0.0
        for lo in range(0, w.shape[0], rows):  # float64, `rows` rows at a time
            wf = w[lo: lo + rows].double()
            approx = wb[lo: lo + rows].double()
            approx_norm = approx.norm(dim=1)
            err = (wf - approx).norm(dim=1) + 2 * gamma * (wf.norm(dim=1) + approx_norm)
            max_err, max_norm = max(max_err, float(err.max())), max(max_norm, float(approx_norm.max()))
        self.max_err = max_err * (1 + 1e-4)
        self.max_norm = max_norm * (1 + 1e-4)

    @classmethod
    def prepare(cls, w: torch.Tensor) -> CpuHeadPick | None:
        """The pick for head w (float32 or half), or None where a packed bf16 copy cannot be made
        or its product of a probe row disagrees with F.linear's (cpu_linear.agrees)."""
        from fgchat.engine.devices import cpu_computes_bf16

        if w.device.type != "cpu" or not cpu_computes_bf16():
            return None
        ram = physical_memory_bytes()
        if ram is not None and 2 * w.numel() > ram // PACK_RAM_SHARE:  # the copy is extra memory
            return None
        try:
            wb = w.to(torch.bfloat16)
            packed = pack(wb)
            x = torch.linspace(-1.0, 1.0, w.shape[1], dtype=torch.bfloat16)[None]
            if not agrees(packed_linear(x, packed), torch.nn.functional.linear(x, wb)):
                return None
        except (RuntimeError, AttributeError, NotImplementedError):  # no oneDNN bf16 in this torch
            return None
        return cls(w, wb, packed)

    def pick(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xb = x.to(torch.bfloat16)
        logits = packed_linear(xb, self.packed).float()
        xf = x.float()
        beta = ROUNDING * logits.abs().amax(dim=1) + xf.norm(dim=1) * self.max_err
        if x.dtype != torch.bfloat16:
            beta += (xf - xb.float()).norm(dim=1) * self.max_norm
        cand = (logits >= (logits.amax(dim=1) - 2 * beta)[:, None]).any(dim=0).nonzero()[:, 0]  # ascending
        if cand.numel() == 0:  # NaN logits: every row, as the exact head would see them
            cand = torch.arange(logits.shape[1])
        # float64 sums of the exact products, each row reduced alike: equal rows give equal logits
        exact = (xf.double()[:, None, :] * self.w[cand].double()[None]).sum(dim=-1)
        logits[:, cand] = exact.float()
        return logits, cand[exact.argmax(dim=1)]
