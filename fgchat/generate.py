"""`fgchat generate`: headless generation with a latency summary.

Model text goes to stdout: on a terminal without control or escape sequences (a model cannot
drive the terminal), to a pipe or file exactly as generated. When the reader of a pipe goes away
(`fgchat generate ... | head -c 20`) generation stops and the command exits quietly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from fgchat.protocol.errors import FgchatError, RequestError
from fgchat.stdio import TerminalSanitizer, is_tty, one_line, sanitize_terminal_text, silence_stdout
from fgchat.protocol.events import (
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


EXIT_BROKEN_PIPE = 141


class _Stdout:
    """Model text to stdout: control sequences removed on a TTY; a closed pipe ends the output
    (stdout is pointed at devnull) instead of raising."""

    def __init__(self) -> None:
        self.tty = is_tty(sys.stdout)
        self.sanitizer = TerminalSanitizer() if self.tty else None
        self.broken = False

    def stream(self, text: str) -> None:
        self.write(self.sanitizer.feed(text) if self.sanitizer else text)

    def print(self, text: str, *, clean: bool = True) -> None:
        self.write((sanitize_terminal_text(text) if self.tty and clean else text) + "\n")

    def write(self, text: str) -> None:
        if self.broken or not text:
            return
        try:
            try:
                sys.stdout.write(text)
            except UnicodeEncodeError:  # e.g. PYTHONIOENCODING=ascii: replace what it cannot show
                enc = getattr(sys.stdout, "encoding", None) or "ascii"
                sys.stdout.write(text.encode(enc, "replace").decode(enc))
            sys.stdout.flush()
        except BrokenPipeError:
            self.broken = True
            silence_stdout()


def run_generate(args: argparse.Namespace, config) -> int:
    if not 1 <= args.n <= 8:
        raise RequestError(f"--n must be between 1 and 8, got {args.n}")
    if not args.prompt.strip():
        raise RequestError("the prompt is empty")
    for name, text in (("--prompt", args.prompt), ("--system", args.system)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{name} is not valid UTF-8 (at position {e.start})") from None
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
    out = _Stdout()
    done: dict[int, RequestSummary] = {}
    batch_max = 0
    try:
        while engine.has_work():
            if out.broken:  # nobody reads the text any more: stop generating it
                _cancel(engine, rids, done)
                break
            for ev in engine.step():
                if isinstance(ev, TokenEvent):
                    batch_max = max(batch_max, ev.batch_size)
                    if stream and ev.text:
                        out.stream(ev.text)
                elif isinstance(ev, RequestFinished):
                    done[ev.summary.request_id] = ev.summary
                elif isinstance(ev, EngineError):
                    print(f"fgchat: error: {one_line(ev.message)}", file=sys.stderr)
    except KeyboardInterrupt:
        _cancel(engine, rids, done)
        raise
    finally:
        if stream:
            out.write("\n")
        _report(args, engine, rids, done, batch_max, out)
    if out.broken:
        return EXIT_BROKEN_PIPE
    return 0 if all(s.finish_reason != "error" for s in done.values()) else 1


def _cancel(engine, rids: list[int], done: dict[int, RequestSummary]) -> None:
    for rid in rids:
        engine.cancel(rid)
    for ev in engine.step():
        if isinstance(ev, RequestFinished):
            done[ev.summary.request_id] = ev.summary


def _report(args, engine, rids: list[int], done: dict[int, RequestSummary], batch: int,
            out: _Stdout | None = None) -> None:
    out = out or _Stdout()
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
        out.print(json.dumps(head), clean=False)  # JSON escapes every control character
    elif args.n > 1:
        for i, s in enumerate(sums):
            out.print(f"--- completion {i + 1} ---\n{s.text}")
    for s in sums:
        print(summary_line(s, engine.mode, batch), file=sys.stderr)
