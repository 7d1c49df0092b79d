"""GPU microbenchmark: the LM head's greedy pick from the int8 copy with exact rescoring
(engine.kernels.head_pick) against the exact head kernel's pick (gemv.project_argmax), both as the
decode step launches them (PDL, the engine's head tile), at 1 and 8 rows.

Each runs 50 times inside one CUDA graph (bench_proj's timing), cycling through enough copies of
the head that they do not fit in L2 (every call reads HBM, as a decode step does). Per shape: us
per call, the bytes each reads over its time, the tokens compared (they must be equal), and how
many head tiles pass 2 recomputed per step (median / max over a few inputs).
Inputs: a head of N(0, 0.02) rows and rows x ~ N(0, 1) (a normed hidden state); with --gguf PATH
also the embedded model's own head (its rows x still random). --approx-tiles times pass 1 with
each given tile (block_k,warps,stages,swap) as well as the default. Usage:
    python tools/bench_head_pick.py [135m|1b|8b ...] [--gguf PATH] [--approx-tiles "128,4,6,0 256,4,4,1"]
"""

from __future__ import annotations

import itertools
import statistics
import sys

import torch

from bench_proj import graph_time_us  # tools/ is the script's directory

from fgchat.engine.kernels import gemv, head_pick

L2_BYTES = 60 * 2**20
SHAPES = {"135m": (49152, 576), "1b": (128256, 2048), "8b": (128256, 4096)}


def rescored_tiles(x: torch.Tensor, w: torch.Tensor, head: head_pick.Int8Head, block_n: int) -> list[int]:
    """Per row: head tiles whose logits came back exact (pass 2 recomputes a tile for every row)."""
    logits, _ = head_pick.pick(x, w, head)
    exact = gemv.project_logits(x, w)
    n = w.shape[0] - w.shape[0] % block_n
    same = (logits[:, :n] == exact[:, :n]).view(x.shape[0], -1, block_n).all(dim=2)
    return same.sum(dim=1).tolist()


def bench(name: str, heads: list[torch.Tensor], approx_tiles: list) -> None:
    n, k = heads[0].shape
    int8 = [head_pick.quantize(w) for w in heads]
    block_n = gemv.pick_config(n, k).block_n
    for m in (1, 8):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        tiles = []
        for seed in range(4):
            xs = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
            xs = xs.bfloat16()
            tokens = head_pick.pick(xs, heads[0], int8[0], pdl=True)[1]
            assert torch.equal(tokens, gemv.project_argmax(xs, heads[0], pdl=True)[1]), (name, m, seed)
            tiles += rescored_tiles(xs, heads[0], int8[0], block_n)
        exact = [lambda w=w: gemv.project_argmax(x, w, pdl=True) for w in heads]
        t_exact = graph_time_us(lambda c=itertools.cycle(exact): next(c)())
        for tile in [None, *approx_tiles]:
            head_pick.APPROX_TILE = tile
            approx = [lambda w=w, h=h: head_pick.pick(x, w, h, pdl=True) for w, h in zip(heads, int8)]
            t_int8 = graph_time_us(lambda c=itertools.cycle(approx): next(c)())
            print(f"{name:9} {m:2d} {t_exact:8.1f} {t_int8:8.1f} {t_int8 / t_exact:6.3f} "
                  f"{n * k * 2 / t_exact / 1e3:6.0f} {n * k / t_int8 / 1e3:6.0f} "
                  f"{statistics.median(tiles):5.0f} {max(tiles):5d} / {-(-n // block_n)}  {tile or 'default'}",
                  flush=True)
        head_pick.APPROX_TILE = None


def main() -> None:
    args = sys.argv[1:]
    gguf, approx_tiles = None, []
    if "--gguf" in args:
        gguf = args.pop(args.index("--gguf") + 1)
        args.remove("--gguf")
    if "--approx-tiles" in args:
        text = args.pop(args.index("--approx-tiles") + 1)
        args.remove("--approx-tiles")
        approx_tiles = [tuple(int(v) for v in t.split(",")) for t in text.split()]
        approx_tiles = [(b, w, s, bool(sw)) for b, w, s, sw in approx_tiles]
    print(f"{'head':9} {'M':>2} {'exact':>8} {'int8':>8} {'ratio':>6} {'GB/s':>6} {'GB/s':>6} "
          f"{'tiles':>5} {'max':>5}  (us per call; GB/s: the head's bytes / time, int8 bytes / time; "
          f"tiles rescored per step (any row): median, max / all)")
    for name in args or ["135m", "1b", "8b"]:
        n, k = SHAPES[name]
        copies = max(2, -(-3 * L2_BYTES // (n * k)))  # the int8 copies must not fit either
        heads = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        bench(name, heads, approx_tiles)
        del heads
    if gguf:
        from fgchat.engine.loader import load_model

        w = load_model(gguf, torch.device("cuda"), torch.bfloat16).weights.lm_head.contiguous()
        copies = max(2, -(-3 * L2_BYTES // w.numel()))
        bench("embedded", [w] + [w.clone() for _ in range(copies - 1)], approx_tiles)


if __name__ == "__main__":
    main()
