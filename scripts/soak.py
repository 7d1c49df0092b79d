"""Soak the engine for a bounded time: random prompts, K completions per prompt (1..8), random
cancellations, random mode switches, duplicate-id and over-long submissions; reports resident
memory at the start and the end, and fails (exit 1) if a request is lost or memory grows.

    python3 scripts/soak.py [--minutes 3] [--model M] [--device cpu] [--seed 0]

Memory: VmRSS from /proc/self/status after warm-up and at the end; "growth" allows 64 MiB of
allocator noise. Every submitted request must finish (stop, length or cancelled) exactly once.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

WORDS = ("the cat sat on a mat while graphs replay kernels in order and tokens stream out of the "
         "engine one by one at every batch size from one to eight").split()


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="as fgchat --dtype (default: auto, the chat's default)")
    args = ap.parse_args()
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.errors import RequestError
    from fgchat.protocol.events import RequestFinished, SamplingParams

    rng = random.Random(args.seed)
    eng = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_context=512))
    tok = eng.tokenizer
    submitted: set[int] = set()
    finished: dict[int, str] = {}
    refused = 0

    def prompt() -> list[int]:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        return tok.apply_chat_template([{"role": "user", "content": text}]) if tok else [1, 2, 3]

    def drain(events) -> None:
        for ev in events:
            if isinstance(ev, RequestFinished):
                rid = ev.summary.request_id
                if rid in finished:
                    raise SystemExit(f"request {rid} finished twice")
                finished[rid] = ev.summary.finish_reason

    # warm-up: one of each batch size, so the baseline RSS includes what a steady state holds
    for k in range(1, 9):
        for _ in range(k):
            submitted.add(eng.submit(prompt(), SamplingParams(max_tokens=4)))
        drain(eng.run_until_done())
    start_rss, t0, steps = rss_mib(), time.monotonic(), 0
    deadline = t0 + args.minutes * 60
    while time.monotonic() < deadline:
        if rng.random() < 0.3 and len(eng.scheduler.waiting) < 16:
            ids = prompt()
            temp = rng.choice([0.0, 0.7])
            for i in range(rng.randint(1, 8)):
                sp = SamplingParams(temperature=temp, seed=i, max_tokens=rng.randint(1, 48))
                submitted.add(eng.submit(ids, sp))
        if rng.random() < 0.05 and submitted - finished.keys():
            eng.cancel(rng.choice(sorted(submitted - finished.keys())))
        if rng.random() < 0.02:
            eng.set_mode(rng.choice(["eager", "piecewise", "full"]))
        if rng.random() < 0.05:
            live = sorted(submitted - finished.keys())
            bad = [lambda: eng.submit([1] * (eng.max_context + 1))]  # longer than the context
            if live:
                bad.append(lambda: eng.submit([1, 2, 3], request_id=live[0]))  # a duplicate id
            for attempt in bad:  # each is refused, and nothing else happens
                try:
                    attempt()
                    raise SystemExit("an invalid submission was accepted")
                except RequestError:
                    refused += 1
        drain(eng.step())
        steps += 1
    drain(eng.run_until_done())
    end_rss = rss_mib()
    lost = submitted - finished.keys()
    reasons = {r: list(finished.values()).count(r) for r in sorted(set(finished.values()))}
    mins = (time.monotonic() - t0) / 60
    print(f"soak: {mins:.1f} min, {steps} engine steps, {len(submitted)} requests ({reasons}), "
          f"{refused} refused submissions, {len(lost)} lost; RSS {start_rss:.0f} -> {end_rss:.0f} MiB "
          f"(step history {len(eng.step_graphs)} entries)")
    return 1 if lost or end_rss - start_rss > 64 else 0


if __name__ == "__main__":
    sys.exit(main())
