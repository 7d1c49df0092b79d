"""`fgchat bench --endpoint URL`: the benchmark grid against an OpenAI-compatible server.

Measured as the engine bench measures the engine (TTFT, TPOT, ITL per batch size and mode), but at
the client through EndpointClient: "batch size" B means B concurrent streams, each one request
with its own prompt. On an fgchat server every requested mode is switched to in turn (unavailable
ones are reported as skipped) and GPU / launch time per step come from its per-token extension;
any other server runs as one runner, "endpoint", without them.

Invariants:
- The result has the engine bench's shape, so the same report, JSON and CSV writers take it.
- Timings include HTTP and the server's own overhead; meta["timing"] says so.
- A batch size whose round fails (a stream cut, a request the server failed, a timeout) is
  reported in `skipped` as "batch B: why", its streams are cancelled, and the run goes on: the
  rows measured before and after it are kept. A server that cannot be used at all (unreachable,
  the key refused) ends the run as one FgchatError line.
- A round counts only its own requests' events: a failed round's late events never reach the next.
- Nothing here imports torch or the engine.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import time
from typing import Any

from fgchat.metrics.stats import summarize
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import EngineError, EngineInfo, ModeChanged, RequestFinished, SamplingParams, TokenEvent

WORDS = ("time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child",
         "eye", "woman", "place", "work", "week", "case", "point", "number", "group", "problem", "fact")
START_TIMEOUT_S = 60.0
ROUND_TIMEOUT_S = 900.0
# bench options that configure a local engine: meaningless with --endpoint
LOCAL_ONLY = (("preset", None), ("random_weights", False), ("peers", []), ("device", None), ("dtype", "auto"),
              ("attention", "auto"), ("max_context", None), ("outliers", 0.0),
              ("quantize", ["none"]), ("dequantize", False))


def check_endpoint_bench_args(args: argparse.Namespace) -> None:
    for name, default in LOCAL_ONLY:
        value = getattr(args, name, default)
        if value != default and value not in ("", [], None):
            raise FgchatError(f"--{name.replace('_', '-')} configures a local engine; it does not apply "
                              "with --endpoint")


def prompt_text(batch: int, index: int, words: int) -> str:
    """A fixed prompt of `words` words (about as many tokens), different per stream."""
    rng = random.Random(1000 * batch + index)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _stats(values: list[float]) -> dict[str, float | None]:
    s = summarize(values)
    return {"mean": s.mean, "median": s.p50, "p90": s.p90, "p99": s.p99}


class RoundFailed(FgchatError):
    """One round of streams failed; the bench goes on with the next batch size."""


def _rid(ev: Any) -> int | None:
    return ev.summary.request_id if isinstance(ev, RequestFinished) else getattr(ev, "request_id", None)


class _Session:
    def __init__(self, handle: Any) -> None:
        self.h = handle
        self.ids = itertools.count(1)

    def wait(self, done: Any, timeout: float, what: str, rids: set[int] | None = None) -> list:
        """Events until done(events). A fatal error raises FgchatError. With `rids` (a round), only
        those requests' events count, and a failed request or the timeout raises RoundFailed;
        without, events of requests (a failed round's late ones) are left out."""
        out: list = []
        deadline = time.monotonic() + timeout
        while not done(out):
            if time.monotonic() > deadline:
                raise (FgchatError if rids is None else RoundFailed)(f"endpoint bench: timed out waiting for {what}")
            new = self.h.get_events(0.05)
            fatal = [e for e in new if isinstance(e, EngineError) and e.fatal]
            if fatal:
                raise FgchatError(f"endpoint bench: {fatal[0].message}")
            out += [e for e in new if _rid(e) is None or (rids is not None and _rid(e) in rids)]
            failed = [e for e in out if isinstance(e, EngineError) and e.request_id is not None]
            if failed:
                raise RoundFailed(f"endpoint bench: {failed[0].message}")
        return out

    def round(self, batch: int, prompt_len: int, output_len: int) -> tuple[list, list, float]:
        rids = [next(self.ids) for _ in range(batch)]
        t0 = time.perf_counter()
        for i, rid in enumerate(rids):
            msgs = [{"role": "user", "content": prompt_text(batch, i, prompt_len)}]
            self.h.submit_chat(rid, msgs, SamplingParams(max_tokens=output_len, ignore_eos=True, seed=i))
        try:
            evs = self.wait(lambda out: sum(isinstance(e, RequestFinished) for e in out) >= batch,
                            ROUND_TIMEOUT_S, f"{batch} streams", set(rids))
        except RoundFailed:
            for rid in rids:  # the round's other streams stop here; their late events are not counted
                self.h.cancel(rid)
            raise
        wall = time.perf_counter() - t0
        return [e for e in evs if isinstance(e, TokenEvent)], [e.summary for e in evs if isinstance(e, RequestFinished)], wall


def measure(session: _Session, runner: str, mode: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    ttft, tpot, itl, gpu, launch, tok_s = [], [], [], [], [], []
    modes: set[str] = set()
    for rep in range(args.warmup + args.repeats):
        toks, done, wall = session.round(batch, args.prompt_len, args.output_len)
        if rep < args.warmup:
            continue
        ttft += [s.ttft_ms for s in done]
        tpot += [s.tpot_ms for s in done if s.tpot_ms is not None]
        itl += [e.itl_ms for e in toks if not e.is_first_token and e.itl_ms is not None]
        lead = min(s.request_id for s in done)
        steps = [e for e in toks if e.request_id == lead and not e.is_first_token]
        gpu += [e.gpu_step_ms for e in steps if e.gpu_step_ms is not None]
        launch += [e.launch_ms for e in steps if e.launch_ms is not None]
        modes |= {str(e.mode) for e in steps}
        tok_s.append(sum(s.output_tokens for s in done) / wall)
    return {"runner": runner, "mode": mode, "batch_size": batch, "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot),
            "itl_ms": _stats(itl), "gpu_step_ms": _stats(gpu), "launch_ms": _stats(launch),
            "output_tokens_per_s": sum(tok_s) / len(tok_s), "decode_modes": sorted(modes),
            "requests": len(ttft), "host_overhead_ms": None}


def run_endpoint_bench(args: argparse.Namespace) -> dict[str, Any]:
    from fgchat.bench.progress import progress_bar
    from fgchat.bench.interrupted import keeping_finished_runs
    from fgchat.client import EndpointClient

    import sys

    print(f"fgchat bench: timing {args.endpoint} at the client (HTTP and server overhead included)",
          file=sys.stderr)
    handle = EndpointClient(args.endpoint, model=args.model, api_key=args.api_key)
    handle.start()
    session = _Session(handle)
    try:
        evs = session.wait(lambda out: any(isinstance(e, EngineInfo) for e in out), START_TIMEOUT_S,
                           f"{args.endpoint} to answer")
        info = next(e for e in evs if isinstance(e, EngineInfo))
        result = _skeleton(info, args, handle.is_fgchat)
        plan = ([(f"endpoint-{m}", m) for m in args.modes] if handle.is_fgchat else [("endpoint", str(info.mode))])
        with keeping_finished_runs(result), progress_bar(len(plan) * len(args.batch_sizes),
                                                          not args.no_progress) as advance:
            for runner, mode in plan:
                if handle.is_fgchat and not _switch(session, mode, result, runner):
                    continue
                for b in args.batch_sizes:
                    advance(f"{runner} batch {b}")
                    try:
                        result["runs"].append(measure(session, runner, mode, b, args))
                    except RoundFailed as exc:
                        why = str(exc).removeprefix("endpoint bench: ")
                        result["skipped"].append({"runner": runner, "reason": f"batch {b}: {why}"})
                        print(f"fgchat bench: {runner} batch {b} failed ({why}); it is left out, the run goes on",
                              file=sys.stderr)
        return result
    finally:
        handle.shutdown()


def _switch(session: _Session, mode: str, result: dict[str, Any], runner: str) -> bool:
    session.h.set_mode(mode)
    evs = session.wait(lambda out: any(isinstance(e, ModeChanged) for e in out), 600.0, f"mode {mode}")
    ev = next(e for e in evs if isinstance(e, ModeChanged))
    if str(ev.mode) != mode:
        result["skipped"].append({"runner": runner, "reason": ev.reason or f"the server runs {ev.mode}"})
        return False
    return True


def _skeleton(info: EngineInfo, args: argparse.Namespace, fgchat: bool) -> dict[str, Any]:
    return {
        "meta": {
            "model": info.model_name, "device": f"{info.device} via {args.endpoint}", "dtype": info.dtype,
            "attention": info.attention_backend, "commit": "remote", "endpoint": args.endpoint,
            "fgchat_server": fgchat, "timing": "client-side: HTTP and server overhead included",
            "kernel_warmup_s": info.kernel_warmup_s, "startup_check": None,
            "python": platform.python_version(), "prompt_len": args.prompt_len, "output_len": args.output_len,
            "prompt_unit": "words (about as many tokens)", "warmup": args.warmup, "repeats": args.repeats,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "interrupted": False,
        },
        "captures": [], "skipped": [], "runs": [],
    }
