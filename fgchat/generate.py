"""`fgchat generate`: headless generation with a latency summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from fgchat.engine.errors import FgchatError, RequestError
from fgchat.engine.events import (
    EngineError,
    RequestFinished,
    RequestSummary,
    SamplingParams,
    StartupCheck,
    TokenEvent,
)


def build_prompt(engine, args: argparse.Namespace) -> list[int]:
    tok = engine.tokenizer
    if tok is None:
        raise FgchatError("this model has no tokenizer; generate needs one")
    if args.raw:
        return tok.encode(args.prompt, add_special_tokens=True)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def startup_check_text(sc: StartupCheck | None) -> str:
    """The check's outcome in a few words for the capture line ("" when it did not run); a
    failure is reported by its own note line."""
    if sc is None:
        return ""
    verdict = "passed" if sc.passed else f"FAILED, running {sc.fallback or 'it anyway'}"
    return f"startup check {verdict} in {sc.seconds:.2f} s (max rel err {sc.max_rel_err:.3f})"


def _params(args: argparse.Namespace, i: int) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed + i, max_tokens=args.max_tokens,
    )


def summary_line(s: RequestSummary, mode: str, batch: int) -> str:
    tpot = f"{s.tpot_ms:.2f} ms" if s.tpot_ms is not None else "n/a"
    tps = 1000.0 / s.tpot_ms if s.tpot_ms else 0.0
    return (f"[request {s.request_id}] ttft {s.ttft_ms:.1f} ms | tpot {tpot} ({tps:.1f} tok/s) | "
            f"e2e {s.e2e_ms:.0f} ms | prompt {s.prompt_tokens} tok | output {s.output_tokens} tok | "
            f"{s.finish_reason} | mode {mode} | batch {batch}")


def run_generate(args: argparse.Namespace, config) -> int:
    if not 1 <= args.n <= 8:
        raise RequestError(f"--n must be between 1 and 8, got {args.n}")
    if not args.prompt.strip():
        raise RequestError("the prompt is empty")
    for i in range(args.n):
        _params(args, i).validate()
    from fgchat.engine.core import Engine

    engine = Engine(config)
    prompt = build_prompt(engine, args)
    rids = [engine.submit(prompt, _params(args, i)) for i in range(args.n)]
    for note in engine.info().notes:
        print(f"fgchat: {note}", file=sys.stderr)
    info = engine.info()
    caps = info.captures
    check = startup_check_text(info.startup_check)
    if caps:
        secs, mib = sum(c.seconds for c in caps), sum(c.pool_mib for c in caps)
        warm = info.kernel_warmup_s or 0.0
        print(f"fgchat: kernels warmed in {warm:.2f} s; captured {len(caps)} graphs in {secs:.2f} s, "
              f"pools {mib:.0f} MiB{'; ' + check if check else ''}", file=sys.stderr)
    elif check:
        print(f"fgchat: {check}", file=sys.stderr)
    stream = args.n == 1 and not args.json
    done: dict[int, RequestSummary] = {}
    batch_max = 0
    try:
        while engine.has_work():
            for ev in engine.step():
                if isinstance(ev, TokenEvent):
                    batch_max = max(batch_max, ev.batch_size)
                    if stream and ev.text:
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                elif isinstance(ev, RequestFinished):
                    done[ev.summary.request_id] = ev.summary
                elif isinstance(ev, EngineError):
                    print(f"fgchat: error: {ev.message}", file=sys.stderr)
    except KeyboardInterrupt:
        for rid in rids:
            engine.cancel(rid)
        for ev in engine.step():
            if isinstance(ev, RequestFinished):
                done[ev.summary.request_id] = ev.summary
        raise
    finally:
        if stream:
            sys.stdout.write("\n")
            sys.stdout.flush()
        _report(args, engine, rids, done, batch_max)
    return 0 if all(s.finish_reason != "error" for s in done.values()) else 1


def _report(args, engine, rids: list[int], done: dict[int, RequestSummary], batch: int) -> None:
    sums = [done[r] for r in rids if r in done]
    if args.json:
        objs = [
            {"text": s.text, "token_ids": s.token_ids, "ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms,
             "itl_ms": s.itl_ms, "e2e_ms": s.e2e_ms, "prompt_tokens": s.prompt_tokens,
             "output_tokens": s.output_tokens, "finish_reason": s.finish_reason}
            for s in sums
        ]
        head = dict(objs[0]) if objs else {}
        head.update(model=engine.model.name, mode=engine.mode, device=str(engine.device))
        sc = engine.startup_check
        head["startup_check"] = dataclasses.asdict(sc) if sc is not None else None
        if args.n > 1:
            head["completions"] = objs
        print(json.dumps(head))
    elif args.n > 1:
        for i, s in enumerate(sums):
            print(f"--- completion {i + 1} ---\n{s.text}")
    for s in sums:
        print(summary_line(s, engine.mode, batch), file=sys.stderr)
