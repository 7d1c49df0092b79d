"""Which phase of the mega kernel first differs between its persistent launch (grid barriers) and
its phase-by-phase launches (kernel boundaries), for one setting of the kernel's switches.

From the same start (random K/V cache, random ids), phases [0, hi) run both ways for growing hi;
the first hi whose buffers differ names the phase, the buffer and the rows (the batch's, or the
padding rows past it). Random weights of the preset's shape. GPU only.

Usage: python tools/bisect_mega.py PRESET BATCH [+rows] [+xrows]   e.g.
       python tools/bisect_mega.py llama-3.2-1b 1 +rows
(+rows: megakernel.NORM_BATCH_ROWS_ONLY, +xrows: OUT_BATCH_ROWS_ONLY; notes V46, V47)
"""

from __future__ import annotations

import sys

import torch

from timeline_mega import KINDS  # tools/ is the script's directory

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.kernels import megakernel as mk
from fgchat.protocol.events import Mode

BUFFERS = ("h", "stats", "q", "attn", "act", "cnt", "bar")


def phase_name(p: int) -> str:
    if p == 0:
        return "embed"
    layer, kind = divmod(p - 1, mk.PHASES_PER_LAYER)
    return f"layer {layer} {KINDS[1 + kind]}"


def state(layers: mk.DecodeLayers, cache: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {name: getattr(layers, name).clone() for name in BUFFERS}
    out["kv"] = cache.clone()
    return out


def restore(layers: mk.DecodeLayers, cache: torch.Tensor, saved: dict[str, torch.Tensor]) -> None:
    for name in BUFFERS:
        getattr(layers, name).copy_(saved[name])
    cache.copy_(saved["kv"])


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], batch: int) -> list[str]:
    """Per differing buffer: its name, the largest difference, and for the row-major buffers
    (h, q, attn, act: row r is batch row r, rows >= batch are padding) which rows differ."""
    out = []
    for name in a:
        x, y = a[name].float(), b[name].float()
        if torch.equal(x, y):
            continue
        diff = torch.nan_to_num((x - y).abs(), nan=float("inf"))
        where = ""
        if name in ("h", "q", "attn", "act"):
            rows = torch.nonzero(diff.flatten(1).amax(1) > 0).flatten().tolist()
            where = f", rows {rows[:16]} (batch rows: < {batch})"
        out.append(f"{name}: max |diff| {float(diff.max()):.3g}{where}")
    return out


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 2:
        raise SystemExit(__doc__)
    preset, b = args[0], int(args[1])
    flags = set(args[2:])
    eng = Engine(EngineConfig(preset=preset, device="cuda", dtype="bfloat16", max_context=2048, mode="full"))
    layers = eng.modes.modes[Mode.MEGA].layers
    layers.norm_batch_rows_only = "+rows" in flags
    layers.out_batch_rows_only = "+xrows" in flags
    g = torch.Generator(device="cuda").manual_seed(b)
    cache = eng.cache.all
    cache.copy_(torch.randn(cache.shape, generator=g, device="cuda"))
    ids = torch.randint(0, eng.cfg.vocab_size, (b,), device="cuda", generator=g)
    pos = torch.tensor([5, 1900, 0, 640, 64, 1, 1300, 127][:b], device="cuda")
    slots = torch.tensor([3, 0, 7, 1, 2, 4, 5, 6][:b], device="cuda")
    start = state(layers, cache)
    phases = 1 + mk.PHASES_PER_LAYER * eng.cfg.num_layers
    print(f"{preset} batch {b} {' '.join(sorted(flags)) or '(defaults)'}: {phases} phases, "
          f"{layers.programs} programs, tiles {layers.tiles}")
    for hi in range(1, phases + 1):
        restore(layers, cache, start)
        layers.run(ids, pos, slots, persistent=False, phases=(0, hi))
        torch.cuda.synchronize()
        by_phase = state(layers, cache)
        repeats = []
        for _ in range(3):  # a race shows on some launches only
            restore(layers, cache, start)
            layers.run(ids, pos, slots, persistent=True, phases=(0, hi))
            torch.cuda.synchronize()
            repeats.append(differences(state(layers, cache), by_phase, b))
        bad = next((r for r in repeats if r), None)
        if bad:
            runs = sum(1 for r in repeats if r)
            print(f"first difference after phase {hi - 1} ({phase_name(hi - 1)}), in {runs} of 3 launches:")
            for line in bad:
                print("  " + line)
            return
    print("persistent equals phase-by-phase through every phase (3 launches each)")


if __name__ == "__main__":
    main()
