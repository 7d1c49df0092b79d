"""H200 microbenchmark: the decode projections on our kernel (engine.kernels.gemv) with weight
tiles loaded by Hopper's bulk copies (TMA) against the same kernel's pointer loads and cuBLAS,
at 1 and 8 rows, launched as the decode step launches them (PDL; split-K partial sums where the
engine splits; LM head with its greedy pick).

Each variant runs 50 times inside one CUDA graph (bench_proj's timing), cycling through enough
copies of the weight that they do not fit in L2 (every call reads HBM, as a decode step does);
prints us per call, weight GB/s and the largest error against a float32 product.
Usage: python tools/bench_tma_proj.py [1b|135m|8b ...] [--tile ROLE=bn,bk,warps,stages,swap,tma ...]
(--tile adds a variant for that role, e.g. --tile head=64,128,4,4,1,1).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch
import torch.nn.functional as F

from bench_proj import graph_time_us  # tools/ is the script's directory

from fgchat.engine.kernels import gemv

L2_BYTES = 60 * 2**20
SM_COUNT = 132
# name -> [(role, N, K)]; gate_up: N = the intermediate size (weight rows gate | up: 2N)
SHAPES = {
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 8192, 2048), ("head", 128256, 2048)],
    "135m": [("qkv", 960, 576), ("gate_up", 1536, 576), ("down", 576, 1536)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 14336, 4096), ("down", 4096, 14336)],
}
NORM_FED = ("o", "down")  # the engine leaves their partial sums to the next norm


def reference(x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
    y = x.float() @ w.float().T
    if role == "gate_up":
        g, u = y.chunk(2, dim=1)
        return F.silu(g) * u
    return y


def call(role: str, x: torch.Tensor, w: torch.Tensor, cfg: gemv.ProjConfig, split: int):
    """The engine's launch of `role` on w with tile cfg; returns a tensor comparable to reference."""
    if role == "gate_up":
        return lambda: gemv.project_glu(x, w, cfg, pdl=True)
    if role == "head":
        return lambda: gemv.project_argmax(x, w, cfg, pdl=True)[0]
    if split > 1:
        return lambda: gemv.project_partials(x, w, split, cfg, pdl=True).sum(0)
    return lambda: gemv.project(x, w, cfg, pdl=True)


def timed(calls: list) -> float:
    turn = itertools.cycle(calls)
    return graph_time_us(lambda: next(turn)())


def variants(role: str, n: int, k: int, extra: dict) -> list[gemv.ProjConfig]:
    """The pointer-load tile (the baseline), the same tile by TMA (for o: the engine's TMA tile of
    short split slices), then the --tile extras."""
    glu = role == "gate_up"
    pointer = gemv.pick_config(n, k, glu)
    bulk = dataclasses.replace(pointer, tma=True)
    if role in NORM_FED:  # the engine's TMA tile for short split slices, where it applies
        bulk = gemv.short_slice_config(n, k, gemv.pick_split(n, k, SM_COUNT, pointer)) or bulk
    return [pointer, bulk, *extra.get(role, [])]


def main() -> None:
    args = sys.argv[1:]
    extra: dict[str, list[gemv.ProjConfig]] = {}
    models = []
    while args:
        a = args.pop(0)
        if a == "--tile":
            role, _, text = args.pop(0).partition("=")
            extra.setdefault(role, []).append(gemv.ProjConfig.parse(text))
        else:
            models.append(a)
    print(f"{'model':5} {'proj':8} {'M':>2} {'split':>5} {'cublas':>7} {'base':>7} {'variant':>7} {'GB/s':>5} "
          f"{'ratio':>6}  tile  (us per call; base: the pointer-load tile; max error vs float32)")
    for model in models or ["1b", "8b"]:
        for (role, n, k), m in itertools.product(SHAPES[model], (1, 8)):
            glu = role == "gate_up"
            rows = 2 * n if glu else n
            nbytes = rows * k * 2
            copies = max(2, -(-3 * L2_BYTES // nbytes))
            ws = [(torch.randn(rows, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = reference(x, ws[0], role)
            split = gemv.pick_split(n, k, SM_COUNT, gemv.pick_config(n, k, glu)) if role in NORM_FED else 1
            t_cub = timed([lambda w=w: F.linear(x, w) for w in ws])
            base = None
            for cfg in variants(role, n, k, extra):
                tile = f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + (" tma" if cfg.tma else "")
                try:
                    calls = [call(role, x, w, cfg, split) for w in ws]
                    err = (calls[0]().float() - ref).abs().max().item()
                    t = timed(calls)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is reported
                    print(f"{model:5} {role:8} {m:2d}  {tile}: {type(exc).__name__} {str(exc).splitlines()[0][:80]}")
                    continue
                base = base or t
                print(f"{model:5} {role:8} {m:2d} {split:5d} {t_cub:7.1f} {base:7.1f} {t:7.1f} "
                      f"{nbytes / t / 1e3:5.0f} {t / base:6.3f}  {tile}  ({err:.2e})", flush=True)
            del ws


if __name__ == "__main__":
    main()
