"""Argument parsing and orchestration for `fgchat bench`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fgchat.engine.errors import FgchatError


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not vals or any(not 1 <= v <= 8 for v in vals):
        raise argparse.ArgumentTypeError("batch sizes must be between 1 and 8")
    return vals


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark modes and batch sizes (TTFT, TPOT, ITL, GPU time)")
    b.add_argument("--model", default=None, help="model to load (default: embedded) unless --preset")
    b.add_argument("--preset", default=None, help="shape preset from assets/presets (with --random-weights)")
    b.add_argument("--random-weights", action="store_true", help="random weights of the preset's shape")
    b.add_argument("--outliers", type=float, default=0.0, metavar="VALUE",
                   help="with --random-weights: massive activation channels up to VALUE in the residual "
                        "stream, as real models carry them (e.g. 2.5e4; default 0: none)")
    b.add_argument("--modes", default="eager,piecewise,full")
    b.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8])
    b.add_argument("--prompt-len", type=int, default=512)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--peers", default="", help="peers run side by side: hf (= hf-eager,hf-compile), hf-eager, hf-compile")
    b.add_argument("--peer-timeout", type=float, default=420.0, metavar="SECONDS",
                   help="time budget per peer, checked between generate calls; past it the rest of that peer "
                        "is marked skipped and the run goes on (default 420)")
    b.add_argument("--json", default=None, help="write full records as JSON here")
    b.add_argument("--csv", default=None, help="write one row per (runner, batch size) here")
    b.add_argument("--attention", default="auto")
    b.add_argument("--device", default=None)
    b.add_argument("--dtype", default=None)
    b.add_argument("--max-context", type=int, default=None)
    b.add_argument("--no-progress", action="store_true")


def run_bench(args: argparse.Namespace) -> int:
    from fgchat.bench.report import print_report, write_csv, write_json
    from fgchat.bench.runner import BenchSpec, run_all

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("eager", "piecewise", "full")]
    if bad:
        raise FgchatError(f"unknown mode(s) {', '.join(bad)} (choose eager, piecewise, full)")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if any(p not in ("hf", "hf-eager", "hf-compile") for p in peers):
        raise FgchatError(f"unknown peer(s) {args.peers} (known: hf, hf-eager, hf-compile)")
    if args.preset and not args.random_weights:
        raise FgchatError("--preset needs --random-weights (presets carry shapes, not weights)")
    if args.random_weights and not args.preset:
        raise FgchatError("--random-weights needs --preset NAME")
    if args.outliers and not args.random_weights:
        raise FgchatError("--outliers needs --random-weights")
    if not 0.0 <= args.outliers <= 6e4:
        raise FgchatError("--outliers must be between 0 and 60000 (float16's range)")
    if args.prompt_len < 1 or args.output_len < 2 or args.repeats < 1 or args.warmup < 0:
        raise FgchatError("--prompt-len >= 1, --output-len >= 2, --repeats >= 1, --warmup >= 0")
    if not args.peer_timeout > 0:
        raise FgchatError("--peer-timeout must be > 0 seconds")
    for path in (args.json, args.csv):
        if path and not Path(path).resolve().parent.is_dir():
            raise FgchatError(f"cannot write {path}: directory does not exist")
    spec = BenchSpec(
        model=args.model, preset=args.preset, modes=modes, batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len, output_len=args.output_len, warmup=args.warmup,
        repeats=args.repeats, peers=peers, attention=args.attention, device=args.device,
        dtype=args.dtype, max_context=args.max_context, progress=not args.no_progress,
        peer_timeout=args.peer_timeout, outliers=args.outliers,
    )
    result = run_all(spec)
    print_report(result, sys.stdout)
    if args.json:
        write_json(result, Path(args.json))
    if args.csv:
        write_csv(result, Path(args.csv))
    return 0

