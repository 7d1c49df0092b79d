"""H200 sweep of our projection kernel's tiles at the decode step's large shapes, against cuBLAS.

Every variant runs 50 times inside one CUDA graph, launched the way the step launches it (PDL
on); gate/up is timed as the whole job (cuBLAS F.linear + fused.silu_mul vs project_glu), down
also split along K into partial sums (the norm adds them). Prints us per call and TB/s of weight
bytes, and writes the best tile per (model, role) to the JSON path given (FGCHAT_PROJ_CONFIGS
text). Usage: python tools/sweep_proj.py [--json best.json] [--models 1b,8b] [--roles qkv]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from fgchat.engine.kernels import fused as fk
from fgchat.engine.kernels.gemv import ProjConfig, pick_config, project, project_glu, project_partials

sys.path.insert(0, "tools")
from bench_proj import graph_time_us  # noqa: E402

# model -> [(role, N, K)]; gate_up N is the intermediate size (the weight has 2N rows)
SHAPES = {
    "1b": [("gate_up", 8192, 2048), ("qkv", 3072, 2048), ("down", 2048, 8192)],
    "8b": [("gate_up", 14336, 4096), ("qkv", 6144, 4096), ("down", 4096, 14336), ("o", 4096, 4096)],
    "135m": [("gate_up", 1536, 576)],
}
# bn, bk, warps, stages, swap
TILES = ["16,512,4,4", "32,256,4,4", "64,128,4,4", "64,256,4,3", "64,128,4,4,1", "64,256,4,3,1",
         "128,64,4,4,1", "64,64,4,6,1"]
# narrower outputs (qkv): more programs per SM, deeper pipelines
EXTRA_TILES = ["32,256,4,3", "32,128,4,6", "16,256,4,6", "32,512,4,2", "64,128,4,6,1", "32,256,8,4",
               "16,128,4,8", "32,128,4,4,1"]


def cases(role: str, n: int, k: int, m: int):
    """(label, weight bytes, cuBLAS fn, ours(cfg) -> fn) for one shape."""
    x = torch.randn(m, k, device="cuda").bfloat16()
    rows = 2 * n if role == "gate_up" else n
    w0 = (torch.randn(rows, k, device="cuda") * 0.02).bfloat16()
    nbytes = w0.numel() * 2
    # consecutive calls read different copies, >= 256 MiB in all: weights stream from HBM as in
    # the step (each layer's weights are read once), not from the 50 MB L2
    copies = [w0] + [w0.clone() for _ in range(-(-(256 << 20) // nbytes) - 1)]
    turn = itertools.count()

    def w():
        return copies[next(turn) % len(copies)]

    if role == "gate_up":
        yield "glu", nbytes, lambda: fk.silu_mul(F.linear(x, w()), pdl=True), \
            lambda cfg: (lambda: project_glu(x, w(), cfg, pdl=True))
        return
    yield "plain", nbytes, lambda: F.linear(x, w()), lambda cfg: (lambda: project(x, w(), cfg, pdl=True))
    if role in ("down", "o"):
        yield "split2", nbytes, None, lambda cfg: (lambda: project_partials(x, w(), 2, cfg, pdl=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default="1b,8b,135m")
    ap.add_argument("--roles", default="", help="comma-separated roles (default all); adds EXTRA_TILES")
    args = ap.parse_args()
    roles = set(filter(None, args.roles.split(",")))
    tiles = TILES + EXTRA_TILES if roles else TILES
    best: dict[str, dict] = {}
    print(f"{'model':5} {'role':8} {'variant':7} {'M':>2} {'cublas':>7} {'rule':>7} {'best':>7} {'TB/s':>5}  tile")
    for model in args.models.split(","):
        for role, n, k in SHAPES[model]:
            if roles and role not in roles:
                continue
            for m in (1, 8):
                for label, nbytes, ref, ours in cases(role, n, k, m):
                    t_ref = graph_time_us(ref) if ref else float("nan")
                    rule = pick_config(n, k, glu=role == "gate_up")
                    try:
                        t_rule = graph_time_us(ours(rule))
                    except Exception:  # noqa: BLE001 - the rule's tile may not fit a split
                        t_rule = float("nan")
                    res = []
                    for text in tiles:
                        try:
                            res.append((graph_time_us(ours(ProjConfig.parse(text))), text))
                        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit
                            print(f"  skip {text}: {type(exc).__name__}", file=sys.stderr)
                    if not res:
                        continue
                    t, text = min(res)
                    print(f"{model:5} {role:8} {label:7} {m:2d} {t_ref:7.1f} {t_rule:7.1f} {t:7.1f} "
                          f"{nbytes / t / 1e6:5.2f}  {text}   all: "
                          + " ".join(f"{tt:.1f}" for tt, _ in res), flush=True)
                    best.setdefault(f"{model}/{role}/{label}", {})[str(m)] = {
                        "cublas_us": t_ref, "rule_us": t_rule, "best_us": t, "tile": text,
                        "all": {tx: tt for tt, tx in res}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
