#!/usr/bin/env python3
"""Start-up timeline of the fgchat TUI: from launch to "ready to send", phase by phase.

Each run launches a fresh interpreter that goes through the TUI's own start path (command line
parsed by fgchat.cli, then fgchat.tui.build_app, as `fgchat` does) and runs the app headless
with Textual's `run_test`, until the engine's EngineInfo makes the app's link "ready". The UI
process and the engine child write time stamps (time.monotonic, one clock for every process of
the machine) to the file named by $FGCHAT_STARTUP_TRACE; this script reads them back and prints
each phase in ms since launch, the median over --runs.

Needs no GPU (and no terminal); on a GPU machine the same command also shows what the engine
reports about its GPU-only start-up work (Triton warm-up, graph capture, the start-up check).

    .venv/bin/python tools/startup_time.py                  # the embedded model (converted once)
    .venv/bin/python tools/startup_time.py --tiny           # a tiny random model (tests/tiny_models.py)
    .venv/bin/python tools/startup_time.py --model DIR --runs 5 --json out.json

This file's top level imports only the standard library: the engine child (multiprocessing
"spawn") imports this file again as its main module, as it imports the `fgchat` entry script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACE_ENV = "FGCHAT_STARTUP_TRACE"  # fgchat.engine.startup_trace.STARTUP_TRACE_ENV
REPO = Path(__file__).resolve().parent.parent
SIZE = (120, 40)

# Every mark; label -> what happened. Rows print in the order they happened (median time).
# "ui:" marks are the UI process, "engine:" the engine child, "script:" this script's measured run.
PHASES: list[tuple[str, str]] = [
    ("script: interpreter up", "UI process: Python started, this script's first line"),
    ("script: cli parsed", "fgchat.cli imported, arguments parsed"),
    ("ui: engine spawned", "engine child process started (spawn returned)"),
    ("engine: child started", "engine child: interpreter up, its entry point runs"),
    ("engine: cuda context primed", "engine child, helper thread: CUDA driver and context started"),
    ("engine: imports done", "engine child: torch and the engine imported"),
    ("engine: triton key primed", "engine child, helper thread: Triton's cache key computed"),
    ("engine: model loaded", "engine child: config, tokenizer, weights loaded"),
    ("engine: kv cache allocated", "engine child: KV cache allocated"),
    ("engine: decode path set up", "engine child: decoder, attention, step program, modes"),
    ("engine: warmed and captured", "engine child: kernel warm-up, first graphs (all unless idle capture)"),
    ("engine: built", "engine child: engine built (KV cache, warm-up, capture, check)"),
    ("engine: info sent", "engine child: EngineInfo sent to the UI"),
    ("ui: app imported", "UI process: Textual and the app imported"),
    ("ui: app built", "UI process: app constructed (store, settings, themes)"),
    ("ui: mounted", "UI process: app mounted (first screen composed)"),
    ("script: pilot ready", "UI process: run_test handed over (first screen shown)"),
    ("ui: ready", "UI process: EngineInfo handled, the link is ready to send"),
    ("script: ready seen", "UI process: this script saw the link ready (5 ms polling)"),
]


# ---------------------------------------------------------------- the measured run (a child)
def _mark(label: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{label}\t{time.monotonic():.6f}\n")


def _measured_run(opts: dict) -> int:
    """One launch: the TUI start path of `fgchat`, headless, until the engine is ready."""
    _mark("script: interpreter up")
    import asyncio

    from fgchat.cli import build_parser

    argv = []
    for name in ("model", "device", "mode", "dtype", "max_context"):
        if opts.get(name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(opts[name])]
    args = build_parser().parse_args(argv)
    _mark("script: cli parsed")
    kwargs = dict(model=args.model, mode=args.mode, attention=args.attention, max_context=args.max_context,
                  device=args.device, dtype=args.dtype, lazy_capture=args.lazy_capture)
    import fgchat.tui

    app = fgchat.tui.build_app(**kwargs)
    result = asyncio.run(_drive(app, float(opts["timeout"])))
    Path(opts["result"]).write_text(json.dumps(result))
    return 0 if result["state"] == "ready" else 1


async def _drive(app, timeout: float) -> dict:
    import asyncio

    async with app.run_test(headless=True, size=SIZE):
        _mark("script: pilot ready")
        deadline = time.monotonic() + timeout
        while app.link.state == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        _mark("script: ready seen")
        await asyncio.sleep(0.05)  # let the ready handler's notice land
        info = app.link.info
        out = {"state": app.link.state, "error": app.link.error,
               "notices": [text for _sev, text in getattr(app, "notices", [])]}
        if info is not None:
            check = info.startup_check
            out.update(
                model=info.model_name, device=info.device, dtype=info.dtype, mode=str(info.mode),
                kernel_warmup_s=info.kernel_warmup_s,
                capture_s=sum(c.seconds for c in info.captures), captures=len(info.captures),
                startup_check_s=check.seconds if check is not None else None,
            )
        return out


# ---------------------------------------------------------------- the driver
def _read_trace(path: Path, t0: float) -> dict[str, float]:
    """label -> ms since launch (the first time each label was written)."""
    marks: dict[str, float] = {}
    if not path.exists():
        return marks
    for line in path.read_text(encoding="utf-8").splitlines():
        label, _, stamp = line.rpartition("\t")
        try:
            marks.setdefault(label, (float(stamp) - t0) * 1000.0)
        except ValueError:
            continue
    return marks


def launch_once(opts: dict, work: Path, run: int) -> tuple[dict[str, float], dict]:
    trace = work / f"trace-{run}.tsv"
    result_path = work / f"result-{run}.json"
    data = work / f"data-{run}" if opts["data_dir"] is None else Path(opts["data_dir"])
    env = dict(os.environ, **{TRACE_ENV: str(trace), "FGCHAT_DATA_DIR": str(data)})
    child_opts = dict(opts, result=str(result_path))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measured-run", json.dumps(child_opts)],
                          env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=float(opts["timeout"]) + 60.0)
    total = (time.monotonic() - t0) * 1000.0
    marks = _read_trace(trace, t0)
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"startup_time: measured run {run} failed (exit {proc.returncode}): {tail[0]}")
    result["process_exit_ms"] = total
    return marks, result


def _table(runs: list[dict[str, float]]) -> list[tuple[str, str, float, float]]:
    """(label, description, median ms since launch, ms since the same process's previous row).
    The engine child's rows count from the spawn (its first row) on."""
    rows = []
    known = {label for label, _ in PHASES}
    labels = [(label, text) for label, text in PHASES if any(label in r for r in runs)]
    labels += sorted({(label, "") for r in runs for label in r if label not in known})
    prev = {"ui": 0.0, "engine": 0.0}
    for label, text in sorted(labels, key=lambda lt: statistics.median(r[lt[0]] for r in runs if lt[0] in r)):
        at = statistics.median(r[label] for r in runs if label in r)
        if label == "ui: engine spawned":
            prev["engine"] = at
        proc = "engine" if label.startswith("engine:") else "ui"
        rows.append((label, text, at, at - prev[proc]))
        prev[proc] = at
    return rows


def _tiny_model(work: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models  # tests/tiny_models.py: needs torch and transformers

    return tiny_models.build_model(work / "tiny-llama", "llama")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Start-up timeline of the fgchat TUI (launch -> ready to send).")
    p.add_argument("--model", default=None, help="as fgchat --model (default: the embedded model)")
    p.add_argument("--tiny", action="store_true", help="a tiny random llama built in a temp dir instead")
    p.add_argument("--device", default=None, help="as fgchat --device (default: auto)")
    p.add_argument("--mode", default=None, help="as fgchat --mode (default: the engine's choice)")
    p.add_argument("--dtype", default=None, help="as fgchat --dtype")
    p.add_argument("--max-context", type=int, default=None, help="as fgchat --max-context")
    p.add_argument("--runs", type=int, default=3, help="launches; the table shows medians (default: 3)")
    p.add_argument("--data-dir", default=None,
                   help="FGCHAT_DATA_DIR of the measured runs (default: a fresh temp dir per run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take to be ready")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every run's marks here")
    p.add_argument("--measured-run", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measured_run is not None:
        return _measured_run(json.loads(args.measured_run))
    if args.runs < 1:
        p.error("--runs must be >= 1")
    with tempfile.TemporaryDirectory(prefix="fgchat-startup-") as tmp:
        work = Path(tmp)
        model = args.model
        if args.tiny:
            model = str(_tiny_model(work))
        opts = dict(model=model, device=args.device, mode=args.mode, dtype=args.dtype,
                    max_context=args.max_context, data_dir=args.data_dir, timeout=args.timeout)
        runs, results = [], []
        for i in range(args.runs):
            marks, result = launch_once(opts, work, i)
            if result["state"] != "ready":
                print(f"startup_time: run {i}: engine {result['state']}: {result['error']}", file=sys.stderr)
                return 1
            runs.append(marks)
            results.append(result)
    last = results[-1]
    print(f"model {last.get('model')} on {last.get('device')} ({last.get('dtype')}, {last.get('mode')}); "
          f"{args.runs} launch(es), median ms since launch")
    rows = _table(runs)
    width = max([len("phase")] + [len(label) for label, _, _, _ in rows])
    print(f"{'phase':{width}s} {'at ms':>8s} {'+ms':>8s}  what (+ms: since the same process's previous row)")
    for label, text, at, delta in rows:
        print(f"{label:{width}s} {at:8.0f} {delta:8.0f}  {text}")
    ready = [r.get("ui: ready", r.get("script: ready seen")) for r in runs]
    print(f"ready to send: median {statistics.median(ready):.0f} ms (runs: {', '.join(f'{x:.0f}' for x in ready)})")
    gpu = [(k, statistics.median(r[k] for r in results if r.get(k) is not None))
           for k in ("kernel_warmup_s", "capture_s", "startup_check_s")
           if any(r.get(k) is not None for r in results) and (k != "capture_s" or last.get("captures"))]
    if gpu:
        print("inside 'engine built' (GPU-only work, median s): "
              + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in gpu))
    shown = [n for n in last.get("notices", []) if "ready in" in n]
    if shown:
        print(f"the app showed: {shown[0]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
