"""`fgchat generate`: headless generation with a latency summary.

Model text goes to stdout: on a terminal without control or escape sequences (a model cannot
drive the terminal), to a pipe or file exactly as generated. When the reader of a pipe goes away
(`fgchat generate ... | head -c 20`) generation stops and the command exits quietly; any other
failure to write stdout (disk full) also stops it, and is one error line after the summary.
SIGTERM and SIGHUP stop generation like ctrl+c: the text so far, the JSON and the summary still
come out, and the exit status is 128 + the signal number.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from typing import Any

from fgchat.cli_args import STDOUT_CLOSED, write_stdout
from fgchat.protocol.errors import FgchatError, RequestError
from fgchat.stdio import TerminalSanitizer, is_tty, one_line, sanitize_terminal_text, silence_stdout
from fgchat.protocol.events import (
    EngineError,
    RequestFinished,
    RequestSummary,
    SEED_SPACE,
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


# Sampling. The model's generation_config.json (EngineInfo.sampling_defaults) is the default; each
# sampling flag given overrides its one value; --greedy starts from plain greedy decoding instead
# of the model's defaults (the penalty flags still apply). --n > 1 at temperature 0 samples the n
# completions at N_TEMPERATURE (greedy would give n identical copies), as the TUI does for K > 1
# (fgchat.tui.replies.K_TEMPERATURE); --greedy keeps them greedy.
N_TEMPERATURE = 0.7
SAMPLING_FLAGS = {  # SamplingParams field -> flag
    "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
}


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the user's flags set (a flag left out is None: model default)."""
    out = {k: getattr(args, k, None) for k in SAMPLING_FLAGS}
    out = {k: v for k, v in out.items() if v is not None}
    if getattr(args, "greedy", False):
        out["temperature"] = 0.0
    return out


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Fail with one line, before any model loads, when a sampling flag is out of range."""
    SamplingParams(seed=args.seed, max_tokens=args.max_tokens, **sampling_overrides(args)).validate()
    if args.seed + args.n - 1 >= SEED_SPACE:  # completion i uses seed + i
        raise RequestError(f"--seed {args.seed} with --n {args.n}: the seeds seed..seed+n-1 must all "
                           f"be in [0, 2^63); use --seed <= {SEED_SPACE - args.n}")


def effective_sampling(args: argparse.Namespace, defaults: SamplingParams,
                       source: str) -> tuple[list[SamplingParams], str]:
    """The n completions' parameters and where they come from, e.g. "generation_config.json",
    "built-in greedy", "generation_config.json + --temperature" or "--greedy"."""
    greedy = bool(getattr(args, "greedy", False))
    over = sampling_overrides(args)
    base = SamplingParams() if greedy else defaults
    params = dataclasses.replace(base, seed=args.seed, max_tokens=args.max_tokens, **over)
    parts = ["--greedy"] if greedy else [source or "built-in greedy"]
    parts += [SAMPLING_FLAGS[k] for k in SAMPLING_FLAGS if k in over and not (greedy and k == "temperature")]
    if args.n > 1 and params.temperature == 0 and not greedy:
        params = dataclasses.replace(params, temperature=N_TEMPERATURE)
        parts.append(f"--n {args.n} at T {N_TEMPERATURE:g}")
    return [dataclasses.replace(params, seed=args.seed + i) for i in range(args.n)], " + ".join(parts)


def summary_line(s: RequestSummary, mode: str, batch: int, sampling: str = "") -> str:
    tpot = f"{s.tpot_ms:.2f} ms" if s.tpot_ms is not None else "n/a"
    tps = 1000.0 / s.tpot_ms if s.tpot_ms else 0.0
    return (f"[request {s.request_id}] ttft {s.ttft_ms:.1f} ms | tpot {tpot} ({tps:.1f} tok/s) | "
            f"e2e {s.e2e_ms:.0f} ms | prompt {s.prompt_tokens} tok | output {s.output_tokens} tok | "
            f"{s.finish_reason} | mode {mode} | batch {batch}" + (f" | {sampling}" if sampling else ""))


EXIT_BROKEN_PIPE = 141


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during generate, handled like ctrl+c; exit status 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def exit_signals_interrupt() -> Iterator[None]:
    """For the body, the first SIGTERM / SIGHUP raises Terminated where SIGINT would raise
    KeyboardInterrupt; later ones are ignored, so the report that follows it completes. A signal
    ignored on entry stays ignored (`nohup`), as Python leaves an ignored SIGINT; outside the main
    thread nothing changes (Python handlers can only be set there)."""
    from fgchat.exit_signals import restore, set_handlers

    seen: list[int] = []

    def on_signal(signum: int, frame) -> None:
        if not seen:
            seen.append(signum)
            raise Terminated(signum)

    previous = set_handlers(on_signal, keep_ignored=True)
    try:
        yield
    finally:
        restore(previous)


class _Stdout:
    """Model text to stdout: control sequences removed on a TTY. A failed write ends the output
    instead of raising (stdout then points at devnull): `broken` is set, and `error` holds the
    one-line error unless it was a closed pipe."""

    def __init__(self) -> None:
        self.tty = is_tty(sys.stdout)
        self.sanitizer = TerminalSanitizer() if self.tty else None
        self.broken = False
        self.error: FgchatError | None = None

    def stream(self, text: str) -> None:
        self.write(self.sanitizer.feed(text) if self.sanitizer else text)

    def print(self, text: str, *, clean: bool = True) -> None:
        self.write((sanitize_terminal_text(text) if self.tty and clean else text) + "\n")

    def write(self, text: str) -> None:
        if self.broken or not text:
            return
        try:
            try:
                write_stdout(text)
            except UnicodeEncodeError:  # e.g. PYTHONIOENCODING=ascii: replace what it cannot show
                enc = getattr(sys.stdout, "encoding", None) or "ascii"
                write_stdout(text.encode(enc, "replace").decode(enc))
        except BrokenPipeError:
            self.broken = True
            silence_stdout()
        except FgchatError as e:
            self.broken = True
            self.error = e


def run_generate(args: argparse.Namespace, config) -> int:
    with exit_signals_interrupt():
        return _generate(args, config)


def _generate(args: argparse.Namespace, config) -> int:
    if sys.stdout is None:
        raise RequestError(STDOUT_CLOSED)
    if not 1 <= args.n <= 8:
        raise RequestError(f"--n must be between 1 and 8, got {args.n}")
    if not args.prompt.strip():
        raise RequestError("the prompt is empty")
    for name, text in (("--prompt", args.prompt), ("--system", args.system)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{name} is not valid UTF-8 (at position {e.start})") from None
    check_sampling_flags(args)
    from fgchat.engine.core import Engine
    from fgchat.engine.model.generation_config import describe_sampling

    engine = Engine(config)
    info = engine.info()
    params, source = effective_sampling(args, getattr(info, "sampling_defaults", SamplingParams()),
                                        getattr(info, "sampling_source", ""))
    sampling = f"sampling {describe_sampling(params[0])} ({source})"
    prompt = build_prompt(engine, args)
    if config.speculate == "oracle":
        _record_oracle(engine, prompt, params)
    stream = args.n == 1 and not args.json
    out = _Stdout()
    done: dict[int, RequestSummary] = {}
    batch_max = 0
    rids: list[int] = []
    # from the first submit on, an interrupt still reports every request submitted
    try:
        for p in params:
            rids.append(engine.submit(prompt, p))
        _print_start_lines(engine, info)
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
        _report(args, engine, rids, done, batch_max, out, (params, source, sampling))
    if out.error is not None:
        raise out.error
    if out.broken:
        return EXIT_BROKEN_PIPE
    return 0 if all(s.finish_reason != "error" for s in done.values()) else 1


def _record_oracle(engine, prompt: list[int], params: list[SamplingParams]) -> None:
    """--speculate oracle: the prompt's greedy continuation from a plain run first, the drafts of
    the measured run (engine.speculate.loop records it as the request ends)."""
    engine.set_speculation("off")
    engine.submit(prompt, SamplingParams(max_tokens=max(p.max_tokens for p in params),
                                         ignore_eos=params[0].ignore_eos))
    engine.run_until_done()
    engine.set_speculation("oracle")


def _print_start_lines(engine, info) -> None:
    """The model's notes, the captures' and the start-up check's line, on stderr."""
    model_notes = getattr(engine.model, "notes", [])  # shown once, also before the engine relays them
    for note in list(info.notes) + [n for n in model_notes if n not in info.notes]:
        print(f"fgchat: {note}", file=sys.stderr)
    caps = info.captures
    check = startup_check_text(info.startup_check)
    if caps:
        secs, mib = sum(c.seconds for c in caps), sum(c.pool_mib for c in caps)
        warm = info.kernel_warmup_s or 0.0
        print(f"fgchat: kernels warmed in {warm:.2f} s; captured {len(caps)} graphs in {secs:.2f} s, "
              f"pools {mib:.0f} MiB{'; ' + check if check else ''}", file=sys.stderr)
    elif check:
        print(f"fgchat: {check}", file=sys.stderr)


def _cancel(engine, rids: list[int], done: dict[int, RequestSummary]) -> None:
    for rid in rids:
        engine.cancel(rid)
    for ev in engine.step():
        if isinstance(ev, RequestFinished):
            done[ev.summary.request_id] = ev.summary


def _report(args, engine, rids: list[int], done: dict[int, RequestSummary], batch: int,
            out: _Stdout | None = None,
            sampling: tuple[list[SamplingParams], str, str] | None = None) -> None:
    out = out or _Stdout()
    params, source, line = sampling or ([], "", "")
    seeds = {rid: p.seed for rid, p in zip(rids, params)}
    sums = [done[r] for r in rids if r in done]
    if args.json:
        objs = [
            {"text": s.text, "token_ids": s.token_ids, "ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms,
             "itl_ms": s.itl_ms, "e2e_ms": s.e2e_ms, "prompt_tokens": s.prompt_tokens,
             "output_tokens": s.output_tokens, "finish_reason": s.finish_reason,
             "seed": seeds.get(s.request_id), "spec": s.spec}
            for s in sums
        ]
        head = dict(objs[0]) if objs else {}
        head.update(model=engine.model.name, mode=engine.mode, device=str(engine.device))
        # the weights as the engine holds them (EngineInfo.weights / weight_bytes / step_bytes)
        head.update(weights=engine.weights_format, weight_bytes=engine.weight_bytes, step_bytes=engine.step_bytes)
        # the sampling every completion ran with (completion i: seed + i) and where it came from
        head["sampling"] = dataclasses.asdict(params[0]) if params else None
        head["sampling_source"] = source
        sc = engine.startup_check
        head["startup_check"] = dataclasses.asdict(sc) if sc is not None else None
        if args.n > 1:
            head["completions"] = objs
        out.print(json.dumps(head), clean=False)  # JSON escapes every control character
    elif args.n > 1:
        for i, s in enumerate(sums):
            out.print(f"--- completion {i + 1} ---\n{s.text}")
    for s in sums:
        print(summary_line(s, engine.mode, batch, line), file=sys.stderr)
