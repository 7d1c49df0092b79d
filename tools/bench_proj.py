"""Microbenchmark of the decode step's projections (CUDA): our skinny projection kernel against
cuBLAS (F.linear) at each role's shape of a model, at 1 and 8 rows. gate_up is timed as the whole
job (F.linear + the SiLU-and-multiply kernel against our fused project_glu), o and down also as
split-K partial sums (the next norm adds them), the LM head with its greedy pick. Each variant runs
50 times inside one CUDA graph (launch overhead excluded), launched as the step launches it
(programmatic dependent launch where the GPU has it), cycling through enough copies of the weight
that every call reads HBM as a decode step does. Prints us per call and weight TB/s; `used` says
whether the engine takes our kernel at that shape. --sweep also tries a list of tiles per role
and prints the best as a FGCHAT_PROJ_CONFIGS value, the way to tune the tiles on a new GPU.

    python tools/bench_proj.py --models 1b,8b
    python tools/bench_proj.py --models 1b --sweep --json best.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Iterator

import torch

REPS = 50
STREAM_BYTES = 256 << 20  # weight copies cycled per variant: well past the L2 of an H100 / H200
# model -> [(role, N, K)]; gate_up's N is the intermediate size (its weight has 2N rows)
SHAPES = {
    "135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 1536, 576), ("down", 576, 1536),
             ("head", 49152, 576)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 8192, 2048), ("down", 2048, 8192),
           ("head", 128256, 2048)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 14336, 4096), ("down", 4096, 14336),
           ("head", 128256, 4096)],
}
# bn,bk,warps,stages[,swap]: narrow and wide column tiles, weight rows as the MMA's M (swap) or not
TILES = ["16,512,4,4", "16,256,4,6", "32,256,4,4", "32,128,4,6", "32,256,4,3", "64,128,4,4",
         "64,256,4,3", "64,128,4,4,1", "64,256,4,3,1", "128,64,4,4,1", "64,64,4,6,1", "128,128,8,3,1"]

Make = Callable[[object], Callable[[], object]]  # config (None: the rule's) -> one call


def graph_time_us(fn: Callable[[], object]) -> float:
    """Best of 5 replays of a graph of REPS calls, us per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / REPS)
    return best


def cases(role: str, n: int, k: int, m: int, pdl: bool) -> Iterator[tuple[str, int, Callable, Make]]:
    """(variant, weight bytes, cuBLAS call or None, ours(config) -> call) for one shape."""
    import torch.nn.functional as F

    from fgchat.engine.kernels import fused
    from fgchat.engine.kernels.gemv import pick_split, project, project_argmax, project_glu, project_partials

    x = torch.randn(m, k, device="cuda").bfloat16()
    rows = 2 * n if role == "gate_up" else n
    w0 = (torch.randn(rows, k, device="cuda") * 0.02).bfloat16()
    nbytes = w0.numel() * 2
    copies = [w0] + [w0.clone() for _ in range(-(-STREAM_BYTES // nbytes) - 1)]
    turn = itertools.count()

    def w() -> torch.Tensor:
        return copies[next(turn) % len(copies)]

    if role == "gate_up":
        yield "glu", nbytes, lambda: fused.silu_mul(F.linear(x, w()), pdl=pdl), \
            lambda cfg: (lambda: project_glu(x, w(), cfg, pdl=pdl))
    elif role == "head":
        yield "argmax", nbytes, lambda: torch.argmax(F.linear(x, w()).float(), dim=-1), \
            lambda cfg: (lambda: project_argmax(x, w(), cfg, pdl=pdl))
    else:
        yield "plain", nbytes, lambda: F.linear(x, w()), lambda cfg: (lambda: project(x, w(), cfg, pdl=pdl))
    if role in ("o", "down"):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        split = max(2, pick_split(n, k, sms))
        yield f"split{split}", nbytes, None, lambda cfg: (lambda: project_partials(x, w(), split, cfg, pdl=pdl))


def try_time(make: Make, cfg: object) -> float:
    try:
        return graph_time_us(make(cfg))
    except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit the shape is skipped
        print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--models", default="135m,1b,8b", help=f"comma separated from {', '.join(SHAPES)}")
    ap.add_argument("--roles", default="", help="comma separated (default: every role)")
    ap.add_argument("--sweep", action="store_true", help="also try each tile of --tiles per role")
    ap.add_argument("--tiles", default=" ".join(TILES), help="the sweep's tiles, bn,bk,warps,stages[,swap] "
                    "separated by spaces")
    ap.add_argument("--json", help="with --sweep: write every time and the best tile per model/role/variant")
    a = ap.parse_args()
    models = a.models.split(",")
    roles = set(filter(None, a.roles.split(",")))
    if set(models) - set(SHAPES):
        ap.error(f"--models: each of {', '.join(SHAPES)}")
    if roles - {r for r, _, _ in SHAPES["1b"]}:
        ap.error("--roles: each of qkv, o, gate_up, down, head")
    if not torch.cuda.is_available():
        sys.exit("bench_proj: needs a CUDA GPU")
    from fgchat.engine.kernels.gemv import ProjConfig, wins_over_cublas
    from fgchat.engine.kernels.pdl import supported

    try:
        tiles = [ProjConfig.parse(t) for t in a.tiles.split()] if a.sweep else []
    except ValueError as exc:
        sys.exit(f"bench_proj: --tiles: {exc}")
    pdl = supported(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, PDL {'on' if pdl else 'off'}; us per call")
    print(f"{'model':5} {'role':8} {'variant':7} {'M':>2} {'cuBLAS':>7} {'ours':>7} {'ratio':>6} {'TB/s':>5} "
          f"{'used':>5}" + ("  best tile" if a.sweep else ""))
    best: dict[str, dict] = {}
    for model in models:
        picks: dict[str, str] = {}
        for role, n, k in SHAPES[model]:
            if roles and role not in roles:
                continue
            used = wins_over_cublas(torch.empty(2 * n if role == "gate_up" else n, k, device="meta"))
            for m in (1, 8):
                for variant, nbytes, ref, ours in cases(role, n, k, m, pdl):
                    t_ref = graph_time_us(ref) if ref else float("nan")
                    t_ours = try_time(ours, None)
                    line = (f"{model:5} {role:8} {variant:7} {m:2d} {t_ref:7.1f} {t_ours:7.1f} "
                            f"{t_ref / t_ours:6.2f} {nbytes / t_ours / 1e6:5.2f} {used!s:>5}")
                    if tiles:
                        res = sorted((t, text) for text, t in ((tt, try_time(ours, c)) for tt, c in
                                                               zip(a.tiles.split(), tiles)) if t == t)
                        if res:
                            line += f"  {res[0][1]} {res[0][0]:.1f}"
                            best.setdefault(f"{model}/{role}/{variant}", {})[str(m)] = {
                                "cublas_us": t_ref, "rule_us": t_ours, "best_us": res[0][0], "tile": res[0][1],
                                "all": {text: t for t, text in res}}
                            if m == 1 and (role not in picks or variant.startswith("split")):
                                picks[role] = res[0][1]
                    print(line, flush=True)
        if picks:
            print(f"{model}: FGCHAT_PROJ_CONFIGS=\"{';'.join(f'{r}={t}' for r, t in picks.items())}\" "
                  "(the best tile per role at one row)")
    if a.json and best:
        with open(a.json, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
