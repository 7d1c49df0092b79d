#!/usr/bin/env python3
"""Load test of `fgchat serve` on localhost: N concurrent streaming clients for a fixed time.

Starts `fgchat serve` on the tiny test model (built in a temporary directory; or --model) on a
free loopback port, runs --clients streaming chat clients for --duration seconds, and prints a
table: completed streams, 429s, other errors, malformed streams, tokens, client TTFT, and the
server's RSS at start and end. Every completed stream is checked: each event is JSON, the stream
ends with [DONE], the choice has a finish_reason. Exit status 1 when any error or malformed stream
was seen. Traffic goes to 127.0.0.1 only; the loop is bounded by --duration.

    .venv/bin/python scripts/load_test.py --clients 32 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fgchat.serve.launch import start_server  # noqa: E402

BACKOFF_429_S = 0.05


def check_stream(lines: list[str]) -> tuple[bool, int, str]:
    """(well formed, content chunks, why not)."""
    data = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
    if not data or data[-1] != "[DONE]":
        return False, 0, "no [DONE] at the end"
    finish, chunks = None, 0
    for d in data[:-1]:
        try:
            obj = json.loads(d)
        except ValueError:
            return False, chunks, "a chunk is not JSON"
        if "error" in obj:
            return False, chunks, f"error chunk: {obj['error'].get('message')}"
        for ch in obj.get("choices", []):
            if ch.get("delta", {}).get("content") is not None:
                chunks += 1
            finish = ch.get("finish_reason") or finish
    if finish not in ("stop", "length"):
        return False, chunks, f"finish_reason {finish!r}"
    return True, chunks, ""


async def client(i: int, base: str, deadline: float, stats: Counter, ttft: list[float], problems: list[str]) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as http:
        while time.monotonic() < deadline:
            body = {"messages": [{"role": "user", "content": f"client {i}: " + "hello " * rng.randint(1, 40)}],
                    "max_tokens": rng.randint(8, 96), "temperature": 0.7, "stream": True,
                    "ignore_eos": rng.random() < 0.5}
            t0 = time.perf_counter()
            try:
                async with http.stream("POST", f"{base}/chat/completions", json=body) as resp:
                    if resp.status_code == 429:
                        stats["429"] += 1
                        await resp.aread()
                        await asyncio.sleep(BACKOFF_429_S)
                        continue
                    if resp.status_code != 200:
                        stats["other_errors"] += 1
                        problems.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                        continue
                    lines, first = [], None
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("data:"):
                            first = time.perf_counter() - t0
                        lines.append(line)
            except httpx.HTTPError as exc:
                stats["other_errors"] += 1
                problems.append(f"{type(exc).__name__}: {exc}")
                continue
            ok, chunks, why = check_stream(lines)
            if ok:
                stats["completed"] += 1
                stats["tokens"] += chunks
                if first is not None:
                    ttft.append(first * 1e3)
            else:
                stats["malformed"] += 1
                problems.append(why)


async def run(base: str, clients: int, duration: float) -> tuple[Counter, list[float], list[str]]:
    stats: Counter = Counter()
    ttft: list[float] = []
    problems: list[str] = []
    deadline = time.monotonic() + duration
    await asyncio.gather(*(client(i, base, deadline, stats, ttft, problems) for i in range(clients)))
    return stats, ttft, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds")
    ap.add_argument("--model", default=None, help="model for the server (default: the tiny test model)")
    ap.add_argument("--max-queue", type=int, default=None, help="the server's --max-queue (default: its own)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            import tiny_models

            model = str(tiny_models.build_model(Path(tmp) / "tiny-llama", "llama"))
        server_args = ["--model", model, "--device", "cpu", "--max-context", "1024"]
        if args.max_queue is not None:
            server_args += ["--max-queue", str(args.max_queue)]
        server = start_server(server_args)
        try:
            rss_start, engine_start = server.rss_kib(), server.rss_kib(children=True)
            t0 = time.monotonic()
            stats, ttft, problems = asyncio.run(run(server.base, args.clients, args.duration))
            wall = time.monotonic() - t0
            rss_end, engine_end = server.rss_kib(), server.rss_kib(children=True)
            health = httpx.get(f"{server.root}/health").json()
        finally:
            rc = server.stop()
    q = statistics.quantiles(ttft, n=100) if len(ttft) >= 2 else [float("nan")] * 99
    rows = [
        ("clients x seconds", f"{args.clients} x {args.duration:.0f}"),
        ("completed streams", stats["completed"]),
        ("HTTP 429 (queue full)", stats["429"]),
        ("other errors", stats["other_errors"]),
        ("malformed streams", stats["malformed"]),
        ("tokens streamed", stats["tokens"]),
        ("tokens/s (all streams)", f"{stats['tokens'] / wall:.0f}"),
        ("client TTFT p50 / p99 ms", f"{q[49]:.0f} / {q[98]:.0f}"),
        ("server RSS start / end MiB", f"{rss_start / 1024:.0f} / {rss_end / 1024:.0f}"),
        ("engine (+ mp helper) RSS start / end MiB", f"{engine_start / 1024:.0f} / {engine_end / 1024:.0f}"),
        ("in flight after the run", f"{health['running']} running, {health['waiting']} waiting"),
        ("server exit status", rc),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for p in sorted(set(problems))[:10]:
        print(f"problem: {p}", file=sys.stderr)
    return 1 if stats["other_errors"] or stats["malformed"] or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
