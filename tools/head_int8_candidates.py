"""How many vocabulary rows an int8 LM-head pick would have to rescore exactly, on real weights.

The idea (notes V63): read an int8 copy of the head (per-row scale s_v) instead of bf16 (half the
bytes of the step's largest weight), get approximate logits a_v, and bound each row's error by
Cauchy-Schwarz, |L_v - a_v| <= ||x|| * ||w_v - s_v q_v|| = beta_v. The exact greedy token lies among
the candidates {v : a_v + beta_v >= max_u (a_u - beta_u)}, which are then computed exactly. This
script runs the embedded model's chats (CPU, float32, 32 greedy tokens each), takes every decode
step's final normed row (and each prefill's last), and prints the candidate counts, checking that the exact argmax is always
among them.

Usage: python tools/head_int8_candidates.py [--model PATH] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fgchat.bench.real_weights import PROMPTS, chat_ids
from fgchat.engine.core import Engine
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.events import SamplingParams


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes as float, scales [V, 1], the rows' error norms [V])."""
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0
    codes = torch.round(w / scale).clamp(-127, 127)
    return codes, scale, (w - codes * scale).norm(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    eng = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32", mode="eager"))
    w = eng.decoder.w.lm_head.float()
    codes, scale, err_norm = int8_rows(w)
    rows: list[torch.Tensor] = []
    plain = eng.decoder.head_logits

    def keep(x: torch.Tensor) -> torch.Tensor:
        rows.append(x[-1:].float().clone())  # one row per step (each chat runs alone)
        return plain(x)

    eng.decoder.head_logits = keep
    for text in PROMPTS:
        eng.submit(chat_ids(eng.tokenizer, text), SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        while eng.has_work():
            eng.step()
    eng.decoder.head_logits = plain
    counts, errors, bounds = [], [], []
    for x in rows:
        exact = (x @ w.T)[0]
        approx = ((x @ codes.T) * scale.T)[0]
        beta = x.norm() * err_norm
        keep_mask = approx + beta >= (approx - beta).max()
        if not keep_mask[int(exact.argmax())]:
            raise SystemExit("the exact argmax fell outside the candidates: the bound is wrong")
        counts.append(int(keep_mask.sum()))
        errors.append(float((approx - exact).abs().max()))
        bounds.append(float(beta.median()))
    counts.sort()
    print(f"head {tuple(w.shape)}, {len(counts)} picks (each chat's prefill pick and decode steps)")
    print(f"candidates per step: median {counts[len(counts) // 2]}, p90 {counts[int(0.9 * len(counts))]}, "
          f"max {counts[-1]}")
    print(f"largest |approx - exact| per step: median {statistics.median(errors):.3f}, max {max(errors):.3f}; "
          f"bound beta (median over rows): {statistics.median(bounds):.3f}")


if __name__ == "__main__":
    main()
