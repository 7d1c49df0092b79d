"""ITL median while the TUI streams vs the same model and mode headless (engine isolation check).

Builds a SmolLM2-135M-shaped model with a small trained tokenizer (tests/tiny_models.py), or
loads --model, then runs REPS rounds of N tokens (FGCHAT_TOKENS, default 256) several ways, after
one warm-up round each (--ways picks them and their order):
  headless  Engine in this process, stepped directly
  spawned   the same in a spawned process (a process of its own, no command/event loop)
  thread    the engine's command/event loop (EngineThread) on a thread of this process
  child     EngineProcess: the engine process exactly as the TUI runs it, no UI
  tui       the Textual app: engine child + UI rendering in this process
Per round it takes the median inter-token latency (the TUI's from its latency log, the one the
console shows) and the median host launch time per step; it prints both per way and each way's
ratio to the first. headless vs spawned isolates the process, spawned vs child the loop,
child vs tui the UI beside it. The tui way needs textual (from wheels where there is no network:
pip install --no-index --find-links DIR textual); without it, one line says so.
Batch K > 1: K replies to one prompt (the TUI's F4), sampled at temperature 0.7 in every way.
Usage: python scripts/tui_vs_headless.py [mode] [K] [--model=PATH] [--ways=headless,child,tui]
(PATH: any model fgchat loads, e.g. the embedded GGUF; random weights can fail the startup check
and run the plain torch ops, so real weights measure the fused path the user gets)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tiny_models  # noqa: E402

from fgchat.engine.core import Engine, EngineConfig  # noqa: E402
from fgchat.engine.process import EngineProcess, EngineThread  # noqa: E402
from fgchat.protocol.events import EngineInfo, RequestFinished, SamplingParams, TokenEvent  # noqa: E402

N, REPS = int(os.environ.get("FGCHAT_TOKENS", 256)), 3
PROMPT = "Tell me about latency."


Rounds = tuple[list[float], list[float]]  # per round after the warm-up: ITL median, launch median


def _params(k: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.7 if k > 1 else 0.0, seed=i)


def _medians(tokens: list) -> tuple[float, float]:
    """ITL and host-launch medians (ms) of one round's token events or records."""
    itl = [t.itl_ms for t in tokens if t.itl_ms is not None]
    launch = [t.launch_ms for t in tokens if t.launch_ms is not None and not t.is_first_token]
    return statistics.median(itl), (statistics.median(launch) if launch else float("nan"))


def _split(rounds: list[tuple[float, float]]) -> Rounds:
    return [r[0] for r in rounds[1:]], [r[1] for r in rounds[1:]]


def headless(model: Path, mode: str, k: int) -> Rounds:
    eng = Engine(EngineConfig(model=str(model), mode=mode, max_context=2048))
    check = eng.startup_check
    print(f"decode path: {'fused Triton kernels' if eng.decoder.fused else 'plain torch ops'}; startup check "
          f"{'not run' if check is None else ('passed' if check.passed else 'FAILED: ' + check.message)}", flush=True)
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    out = []
    for _ in range(REPS + 1):
        for i in range(k):
            eng.submit(ids, _params(k, i))
        out.append(_medians([e for e in eng.run_until_done() if isinstance(e, TokenEvent)]))
    return _split(out)


def _spawned_headless(model: Path, mode: str, k: int, out: Any) -> None:
    out.send(headless(model, mode, k))


def spawned(model: Path, mode: str, k: int) -> Rounds:
    """headless() in a spawned process: the process without the engine's command/event loop."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_spawned_headless, args=(model, mode, k, writer))
    proc.start()
    writer.close()
    try:
        return reader.recv()
    except EOFError:
        sys.exit("tui_vs_headless: the spawned headless run failed")
    finally:
        proc.join()


def driven(model: Path, mode: str, k: int, handle_type: type = EngineProcess) -> Rounds:
    """The engine behind the handle the TUI uses (EngineProcess: its own process; EngineThread: a
    thread of this one), driven as the TUI drives it (one SubmitChats per round), no UI."""
    proc = handle_type(EngineConfig(model=str(model), mode=mode, max_context=2048))
    proc.start()
    try:
        deadline = time.monotonic() + 300
        while not any(isinstance(e, EngineInfo) for e in proc.get_events(0.5)):
            if proc.failed or time.monotonic() > deadline:
                sys.exit("tui_vs_headless: the engine did not start")
        out, rid = [], 0
        for _ in range(REPS + 1):
            reqs = [(rid + i, _params(k, i)) for i in range(k)]
            rid += k
            proc.submit_chats([{"role": "user", "content": PROMPT}], reqs)
            tokens, finished = [], 0
            while finished < k:
                for e in proc.get_events(0.1):
                    if isinstance(e, TokenEvent):
                        tokens.append(e)
                    elif isinstance(e, RequestFinished):
                        finished += 1
                if proc.failed:
                    sys.exit("tui_vs_headless: the engine failed")
            out.append(_medians(tokens))
        return _split(out)
    finally:
        proc.shutdown()


async def with_tui(model: Path, mode: str, data: Path, k: int) -> Rounds:
    from fgchat.tui.app import FgchatApp

    app = FgchatApp(EngineConfig(model=str(model), mode=mode, max_context=2048),
                    sampling=SamplingParams(max_tokens=N, ignore_eos=True), data_path=data)
    engine_log = data / "engine.log"  # the app's engine child writes its stderr there

    def where() -> str:
        lines = engine_log.read_text(errors="replace").splitlines() if engine_log.exists() else []
        return f"engine {app.link.state} {app.link.phase!r}; engine.log: {lines[-1][:160] if lines else '-'}"

    def alive() -> None:  # a crashed app handles no more messages: exit with its error, do not wait
        if app._exception is not None:
            sys.exit(f"tui_vs_headless: the app failed: {type(app._exception).__name__}: {app._exception}")

    async with app.run_test(size=(120, 40)):
        deadline = shown = time.monotonic()
        deadline += 300
        while app.link.state == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            alive()
            if time.monotonic() - shown > 5:
                shown = time.monotonic()
                print(f"tui start: {where()}", flush=True)
        assert app.link.state == "ready", f"{app.link.error}; {where()}"
        print(f"tui ready: {where()}", flush=True)
        app.set_samples(k)
        for i in range(REPS + 1):
            if i == 1:
                cpu0, wall0, tok0 = time.process_time(), time.monotonic(), len(app.latency.log.tokens())
            await app.send_prompt(PROMPT)
            shown = time.monotonic()
            while app.latency.log.request_count < (i + 1) * k:
                await asyncio.sleep(0.25)  # not pilot.pause: it walks every widget's queue each call
                alive()
                if time.monotonic() - shown > 5:  # where a slow run is: a killed run keeps these lines
                    shown = time.monotonic()
                    print(f"tui round {i}: {app.latency.log.request_count} requests, "
                          f"{len(app.latency.log.tokens())} tokens logged, replies in flight {len(app.replies)}; "
                          f"{where()}", flush=True)
        log = app.latency.log
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        streamed = len(log.tokens()) - tok0
        print(f"mode {mode} K {k}: UI process CPU {1e3 * cpu / wall:.0f} ms/s while streaming, "
              f"{1e6 * cpu / streamed:.0f} us per token ({streamed} tokens)")
        rounds = [[r.request_id for r in log.requests()][j * k:(j + 1) * k] for j in range(REPS + 1)]
        tokens = log.tokens()
        medians = [_medians([t for t in tokens if t.request_id in ids]) for ids in map(set, rounds)]
        app.exit()
    return _split(medians)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="full", choices=("eager", "piecewise", "full"))
    ap.add_argument("k", nargs="?", type=int, default=1, help="replies per prompt (the batch)")
    ap.add_argument("--model", type=Path, help="a model fgchat loads (default: a random SmolLM2-shaped one)")
    ap.add_argument("--ways", default="headless,child,tui",
                    help="comma-separated, run in this order: headless (this process), spawned (headless in "
                         "a spawned process), thread (the engine loop on a thread here), child (the engine "
                         "process the TUI uses), tui (the app); the first is the ratio's base")
    a = ap.parse_args()
    mode, k = a.mode, a.k
    if "tui" in a.ways.split(",") and importlib.util.find_spec("textual") is None:
        sys.exit("tui_vs_headless: textual is not installed (pip install textual, or from wheels: "
                 "pip install --no-index --find-links DIR textual)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        model = a.model or tiny_models.build_model(
            Path(tmp) / "m", "llama", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
            intermediate=1536, max_pos=8192, tie=True, dtype="bfloat16")
        ways = {"headless": lambda: headless(model, mode, k), "spawned": lambda: spawned(model, mode, k),
                "thread": lambda: driven(model, mode, k, EngineThread), "child": lambda: driven(model, mode, k),
                "tui": lambda: asyncio.run(with_tui(model, mode, Path(tmp) / "data", k))}
        order = a.ways.split(",")
        if not order or set(order) - set(ways):
            ap.error(f"--ways: pick from {', '.join(ways)}")
        med = {}
        for way in order:
            run = ways[way]  # each way's line as soon as it ends: a killed run keeps them
            print(f"mode {mode} K {k}: {way} starts at {time.monotonic() - t0:.1f} s", flush=True)
            itl, launch = run()
            med[way] = statistics.median(itl)
            print(f"mode {mode} K {k}: {way:8s} ITL median {med[way]:.3f} ms {['%.3f' % x for x in itl]}, "
                  f"host launch {statistics.median(launch):.3f} ms", flush=True)
    base = order[0]
    print(f"RESULT mode={mode} k={k} " + " ".join(f"{w}_ms={m:.4f}" for w, m in med.items())
          + " " + " ".join(f"{w}/{base}={m / med[base]:.3f}" for w, m in med.items() if w != base)
          + " (target <= 1.05)")


if __name__ == "__main__":
    main()
