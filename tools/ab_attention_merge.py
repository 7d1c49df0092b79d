"""Full mode's decode step with the attention splits merged three ways, side by side in one
process per preset (random weights, every lane at position 512): the separate combine kernel
(the default), the last split merging the others one split at a time (V8), and the same merge
reading the live splits eight at a time (V55). ms per step from graph replays back to back (CUDA
events), the three ways alternating for `rounds` rounds.

Usage: python tools/ab_attention_merge.py PRESET[,PRESET] BATCHES [ROUNDS]
       e.g. python tools/ab_attention_merge.py llama-3.2-1b,smollm2-135m 1,8 2
"""

from __future__ import annotations

import sys

import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import Mode
from sweep_mega import ms_per_step, stage_at_512  # tools/ is on sys.path when run as a script

WAYS = {"combine kernel": (False, False), "last split, serial": (True, False), "last split, 8 at once": (True, True)}


def main() -> None:
    presets = sys.argv[1].split(",")
    batches = [int(x) for x in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    print(torch.cuda.get_device_name(), flush=True)
    for preset in presets:
        eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048, mode="full",
                                  lazy_capture=True))
        attn = eng.attention
        if eng.attention_name != "triton":
            raise SystemExit(f"{preset}: attention backend {eng.attention_name}, not triton")
        full = eng.modes.modes[Mode.FULL]
        for b in batches:
            stage_at_512(eng, b)
            splits = attn.num_splits(b, eng.cfg.num_kv_heads, eng.max_context, eng.cfg.head_dim)
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for _ in range(rounds):
                for way, (fuse, unrolled) in WAYS.items():
                    attn.fuse_combine, attn.merge_unrolled = fuse, unrolled
                    full.drop()
                    eng.modes.run(Mode.FULL, b, 0)  # capture outside the timing
                    torch.cuda.synchronize()
                    times[way].append(ms_per_step(eng, Mode.FULL, b))
            cells = " | ".join(f"{w} {' / '.join(f'{t:.3f}' for t in ts)}" for w, ts in times.items())
            print(f"{preset:14} b{b} ({splits} splits): {cells}", flush=True)
        attn.fuse_combine, attn.merge_unrolled = False, True
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
