"""ITL median while the TUI streams vs the same model and mode headless (engine isolation check).

Builds a SmolLM2-135M-shaped model with a small trained tokenizer (tests/tiny_models.py), or
loads --model, and starts each of these ways (--ways picks them; the first is the ratios' base):
  headless  Engine stepped directly, in a spawned process of its own (as `fgchat bench` runs it)
  inprocess the same in this process (beside the app and the other ways' threads, if any)
  thread    the engine's command/event loop (EngineThread) on a thread of this process
  child     EngineProcess: the engine process exactly as the TUI runs it, no UI
  tui       the Textual app: its engine child + UI rendering in this process
Then --rounds + 1 rounds (default 3) of --tokens tokens (default 256): in each round every way runs once,
the order rotating round by round, so a host CPU whose speed drifts (shared cloud hosts do, by tens
of percent within a minute) moves every way alike; the first round is warm-up. Per round it takes
the median inter-token latency (the TUI's from its latency log, the one the console shows) and the
median host launch time per step, and prints both per way and each way's ratio to the first: the
ratio of the medians, and the median of the ratios within a round (paired: both ran in that round).
headless vs child isolates the process, child vs tui the UI beside it. The tui way needs textual
(from wheels where there is no network: pip install --no-index --find-links DIR textual).
Batch K > 1: K replies to one prompt (the TUI's F4), sampled at temperature 0.7 in every way.
Usage: python scripts/tui_vs_headless.py [mode] [K] [--model=PATH] [--ways=headless,child,tui] [--tokens N] [--rounds R]
(PATH: any model fgchat loads, e.g. the embedded GGUF; random weights can fail the startup check
and run the plain torch ops, so real weights measure the fused path the user gets)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import importlib.util
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
from fgchat.tui.store import DEFAULT_SYSTEM_PROMPT  # noqa: E402  (no Textual import)

N, REPS = 256, 3  # tokens per reply, measured rounds: set from --tokens, --rounds
PROMPT = "Tell me about latency."
# every way sends the TUI's first turn of a new chat: its default system prompt and PROMPT (the
# TUI way opens a new chat per round, so no way's context grows from round to round)
MESSAGES = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": PROMPT}]


WAYS = {"headless", "inprocess", "thread", "child", "tui"}
Rounds = tuple[list[float], list[float], list[float]]  # per round after the warm-up: ITL, launch, position medians


def _params(k: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.7 if k > 1 else 0.0, seed=i)


def _medians(tokens: list) -> tuple[float, float, float]:
    """ITL and host-launch medians (ms) of one round's token events or records, and the median
    position in the sequence (the context each way's decode attends over)."""
    itl = [t.itl_ms for t in tokens if t.itl_ms is not None]
    launch = [t.launch_ms for t in tokens if t.launch_ms is not None and not t.is_first_token]
    return (statistics.median(itl), (statistics.median(launch) if launch else float("nan")),
            statistics.median(t.position for t in tokens))


def _split(rounds: list[tuple[float, float, float]]) -> Rounds:
    return [r[0] for r in rounds[1:]], [r[1] for r in rounds[1:]], [r[2] for r in rounds[1:]]


class Headless:
    """Engine in this process, stepped directly."""

    def __init__(self, model: Path, mode: str, k: int) -> None:
        self.k, self.eng = k, Engine(EngineConfig(model=str(model), mode=mode, max_context=2048))
        check = self.eng.startup_check
        print(f"decode path: {'fused Triton kernels' if self.eng.decoder.fused else 'plain torch ops'}; "
              f"startup check {'not run' if check is None else ('passed' if check.passed else 'FAILED: ' + check.message)}",
              flush=True)
        self.ids = self.eng.tokenizer.apply_chat_template(MESSAGES)
        self.seed = 0

    async def round(self) -> tuple[float, float]:
        for _ in range(self.k):
            self.seed += 1
            self.eng.submit(self.ids, _params(self.k, self.seed))
        return _medians([e for e in self.eng.run_until_done() if isinstance(e, TokenEvent)])

    async def close(self) -> None:
        pass


def _headless_process(model: Path, mode: str, k: int, conn: Any) -> None:
    async def serve() -> None:
        runner = Headless(model, mode, k)
        conn.send("ready")
        while conn.recv() == "round":
            conn.send(await runner.round())

    asyncio.run(serve())


class Spawned:
    """Headless in a spawned process of its own (this one may hold the app and its threads), one
    round per request over a pipe."""

    def __init__(self, model: Path, mode: str, k: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_headless_process, args=(model, mode, k, theirs), daemon=True)
        self.proc.start()
        theirs.close()
        if self.conn.recv() != "ready":
            sys.exit("tui_vs_headless: the headless process did not start")

    async def round(self) -> tuple[float, float]:
        self.conn.send("round")
        return self.conn.recv()

    async def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)


class Driven:
    """The engine behind the handle the TUI uses (EngineProcess: its own process; EngineThread: a
    thread of this one), driven as the TUI drives it (one SubmitChats per round), no UI."""

    def __init__(self, model: Path, mode: str, k: int, handle_type: type) -> None:
        self.k, self.rid = k, 0
        self.proc = handle_type(EngineConfig(model=str(model), mode=mode, max_context=2048))
        self.proc.start()
        deadline = time.monotonic() + 300
        while not any(isinstance(e, EngineInfo) for e in self.proc.get_events(0.5)):
            if self.proc.failed or time.monotonic() > deadline:
                sys.exit("tui_vs_headless: the engine did not start")

    async def round(self) -> tuple[float, float]:
        reqs = [(self.rid + i, _params(self.k, self.rid + i)) for i in range(self.k)]
        self.rid += self.k
        self.proc.submit_chats(MESSAGES, reqs)
        tokens, finished = [], 0
        while finished < self.k:
            for e in self.proc.get_events(0.1):
                if isinstance(e, TokenEvent):
                    tokens.append(e)
                elif isinstance(e, RequestFinished):
                    finished += 1
            if self.proc.failed:
                sys.exit("tui_vs_headless: the engine failed")
        return _medians(tokens)

    async def close(self) -> None:
        self.proc.shutdown()


class Tui:
    """The Textual app (its engine child + the UI in this process), prompts sent as a user would."""

    async def start(self, model: Path, mode: str, k: int, data: Path) -> Tui:
        from fgchat.tui.app import FgchatApp

        self.k, self.engine_log = k, data / "engine.log"  # the app's engine child writes its stderr there
        self.app = app = FgchatApp(EngineConfig(model=str(model), mode=mode, max_context=2048),
                                   sampling=SamplingParams(max_tokens=N, ignore_eos=True), data_path=data)
        self.test = app.run_test(size=(120, 40))
        await self.test.__aenter__()
        deadline = shown = time.monotonic()
        deadline += 300
        while app.link.state == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            self.alive()
            if time.monotonic() - shown > 5:
                shown = time.monotonic()
                print(f"tui start: {self.where()}", flush=True)
        assert app.link.state == "ready", f"{app.link.error}; {self.where()}"
        app.set_samples(k)
        self.cpu = self.wall = 0.0
        self.tokens = 0
        return self

    def where(self) -> str:
        log = self.engine_log
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return f"engine {self.app.link.state} {self.app.link.phase!r}; engine.log: {lines[-1][:160] if lines else '-'}"

    def alive(self) -> None:  # a crashed app handles no more messages: exit with its error, do not wait
        if self.app._exception is not None:
            exc = self.app._exception
            sys.exit(f"tui_vs_headless: the app failed: {type(exc).__name__}: {exc}")

    async def round(self) -> tuple[float, float]:
        app, log = self.app, self.app.latency.log
        cpu0, wall0, tok0, done = time.process_time(), time.monotonic(), len(log.tokens()), log.request_count
        shown = time.monotonic()
        await app.chats.new_chat()  # the first turn of a new chat, as every other way sends
        while not await app.send_prompt(PROMPT):  # refused while the last reply still draws
            await asyncio.sleep(0.05)
            self.alive()
        while log.request_count < done + self.k:
            await asyncio.sleep(0.05)  # not pilot.pause: it walks every widget's queue each call
            self.alive()
            if time.monotonic() - shown > 5:  # where a slow run is: a killed run keeps these lines
                shown = time.monotonic()
                print(f"tui: {log.request_count - done}/{self.k} replies done, {len(log.tokens()) - tok0} tokens "
                      f"logged; {self.where()}", flush=True)
        self.cpu += time.process_time() - cpu0
        self.wall += time.monotonic() - wall0
        self.tokens += len(log.tokens()) - tok0
        ids = {r.request_id for r in log.requests()[done:done + self.k]}
        return _medians([t for t in log.tokens() if t.request_id in ids])

    async def close(self) -> None:
        if self.tokens:
            print(f"tui: UI process CPU {1e3 * self.cpu / self.wall:.0f} ms/s while streaming, "
                  f"{1e6 * self.cpu / self.tokens:.0f} us per token ({self.tokens} tokens)")
        self.app.exit()
        await self.test.__aexit__(None, None, None)


async def measure(model: Path, mode: str, k: int, ways: list[str], data: Path) -> dict[str, Rounds]:
    """Start every way, then REPS + 1 rounds in which each way runs once, the order rotating from
    round to round (a drifting host CPU then moves every way alike); the first round is warm-up."""
    t0 = time.monotonic()
    runners: dict[str, Any] = {}
    try:
        for way in ways:
            print(f"mode {mode} K {k}: {way} starts at {time.monotonic() - t0:.1f} s", flush=True)
            if way == "headless":
                runners[way] = Spawned(model, mode, k)
            elif way == "inprocess":
                runners[way] = Headless(model, mode, k)
            elif way in ("thread", "child"):
                runners[way] = Driven(model, mode, k, EngineThread if way == "thread" else EngineProcess)
            else:
                runners[way] = await Tui().start(model, mode, k, data)
        rounds: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
        for r in range(REPS + 1):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:
                rounds[way].append(await runners[way].round())
        return {w: _split(rounds[w]) for w in ways}
    finally:
        for runner in runners.values():
            await runner.close()


def main() -> None:
    global N, REPS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="full", choices=("eager", "piecewise", "full"))
    ap.add_argument("k", nargs="?", type=int, default=1, help="replies per prompt (the batch)")
    ap.add_argument("--model", type=Path, help="a model fgchat loads (default: a random SmolLM2-shaped one)")
    ap.add_argument("--ways", default="headless,child,tui",
                    help=f"comma-separated from {', '.join(sorted(WAYS))}; the first is the ratios' base")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per reply (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up round (default %(default)s)")
    a = ap.parse_args()
    N, REPS = a.tokens, a.rounds
    if N < 2 or REPS < 1:
        ap.error("--tokens must be >= 2 and --rounds >= 1")
    mode, k, ways = a.mode, a.k, a.ways.split(",")
    if set(ways) - WAYS or len(set(ways)) != len(ways):
        ap.error(f"--ways: each of {', '.join(sorted(WAYS))} at most once")
    if "tui" in ways and importlib.util.find_spec("textual") is None:
        sys.exit("tui_vs_headless: textual is not installed (pip install textual, or from wheels: "
                 "pip install --no-index --find-links DIR textual)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        model = a.model or tiny_models.build_model(
            Path(tmp) / "m", "llama", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
            intermediate=1536, max_pos=8192, tie=True, dtype="bfloat16")
        rounds = asyncio.run(measure(model, mode, k, ways, Path(tmp) / "data"))
    med = {}
    for way, (itl, launch, pos) in rounds.items():
        med[way] = statistics.median(itl)
        print(f"mode {mode} K {k}: {way:8s} ITL median {med[way]:.3f} ms {['%.3f' % x for x in itl]}, "
              f"host launch {statistics.median(launch):.3f} ms, position {min(pos):.0f}-{max(pos):.0f}", flush=True)
    base = ways[0]
    paired = {w: statistics.median(x / y for x, y in zip(rounds[w][0], rounds[base][0])) for w in ways if w != base}
    print(f"RESULT mode={mode} k={k} " + " ".join(f"{w}_ms={m:.4f}" for w, m in med.items())
          + " " + " ".join(f"{w}/{base}={m / med[base]:.3f}" for w, m in med.items() if w != base)
          + " " + " ".join(f"{w}/{base}_paired={r:.3f}" for w, r in paired.items())
          + " (target <= 1.05)")


if __name__ == "__main__":
    main()
