"""Command line: the TUI by default (or a client of --endpoint); `generate`, `bench` and `serve` subcommands.

Every user error ends as one line on stderr (`fgchat: error: ...`) and exit status 2, never a
traceback. Option values are checked while parsing (choices, ranges, device names, UTF-8 text,
writable output files), so a bad value fails before any model is loaded. The chat needs a
terminal on stdin and stdout; without one it fails (status 2) before any engine starts.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Sequence

from fgchat.cli_args import (
    ATTENTION_BACKENDS,
    DTYPES,
    MIN_CONTEXT,
    QUANTIZE,
    add_spec_args,
    check_spec_args,
    check_weight_args,
    check_writable,
    context_arg,
    device_arg,
    endpoint_arg,
    model_arg,
    utf8_text,
    write_stdout,
)
from fgchat.protocol.events import MODES

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


def version() -> str:
    """The installed distribution's version, else the package's __version__."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("fgchat")
    except (ImportError, PackageNotFoundError, ValueError):
        from fgchat import __version__

        return __version__


class _VersionAction(argparse.Action):
    """--version: `fgchat <version>` on stdout, exit 0 (the version is looked up only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from fgchat.protocol.errors import FgchatError
        from fgchat.stdio import silence_stdout

        try:
            write_stdout(f"fgchat {version()}\n")
        except BrokenPipeError:
            silence_stdout()
            parser.exit(EXIT_BROKEN_PIPE)
        except FgchatError as exc:
            parser.exit(EXIT_USER_ERROR, f"fgchat: error: {exc}\n")
        parser.exit(0)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option's help unless the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or action.required
                or "%(default)" in text or "default" in text):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line instead of usage + error
        from fgchat.stdio import one_line

        self.exit(EXIT_USER_ERROR, f"fgchat: error: {one_line(message)} (see --help)\n")


# ---------------------------------------------------------------------------- value types
# ---------------------------------------------------------------------------- parser
def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_arg, default=None,
                   help="HF repo id, local model directory or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mode", default=None, choices=[str(m) for m in MODES],
                   help="decode mode (default: full where CUDA graphs work, else eager)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="decode-attention backend")
    p.add_argument("--max-context", type=context_arg, default=None, metavar="TOKENS",
                   help=f"tokens per sequence slot, >= {MIN_CONTEXT}; capped by the model and memory "
                   "(default: the model's maximum, as far as memory allows)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="auto | cpu | cuda | cuda:N (default: auto, CUDA when available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weight and cache dtype (default: auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32)")
    p.add_argument("--lazy-capture", action="store_true", help="capture each batch size's graphs on first use")
    p.add_argument("--quantize", default="none", choices=QUANTIZE,
                   help="quantize a bf16/fp16 model's projections at load: fp8 (e4m3, a scale per output "
                   "channel) or int4 (groups of 128, bf16 scales); not for GGUF files, which run in their "
                   "own format")
    p.add_argument("--dequantize", action="store_true",
                   help="a GGUF file's weights dequantized to bf16 at load (the unquantized path, to compare)")
    add_spec_args(p)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fgchat", description="Terminal chat and latency console with live CUDA-graph modes.")
    p.add_argument("--version", action=_VersionAction, help="print the version and exit")
    _add_engine_args(p)
    p.add_argument("--log-csv", default=None, metavar="PATH",
                   help="append one row per token to this CSV as it happens (default: no log)")
    p.add_argument("--endpoint", type=endpoint_arg, default=None, metavar="URL",
                   help="chat with an OpenAI-compatible server (e.g. http://host:8000/v1) instead of "
                   "starting an engine; --model then names the served model (default: its first)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --endpoint: Bearer key for the server (default: $FGCHAT_API_KEY, else none)")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    g = sub.add_parser("generate", help="headless generation: stream text to stdout, latency summary to stderr",
                       description="Generate text headlessly: the text streams to stdout (terminal control "
                       "sequences removed when stdout is a terminal), a latency summary goes to stderr.")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True, type=utf8_text, help="the user message (required)")
    g.add_argument("--system", default=None, type=utf8_text, help="system prompt, chat mode (default: none)")
    g.add_argument("--raw", action="store_true", help="feed the prompt without the chat template")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most, >= 1")
    # sampling: a flag left out takes the model's generation_config.json value (fgchat.generate)
    model_default = " (default: the model's generation_config.json, else %s)"
    greedy = g.add_mutually_exclusive_group()
    greedy.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0..100 (0: greedy)" + model_default % "0")
    greedy.add_argument("--greedy", action="store_true",
                        help="plain greedy decoding, deterministic: ignore the model's generation_config.json "
                        "(penalty flags still apply; --n completions stay identical)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, in (0, 1]" + model_default % "1")
    g.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens (0: off)" + model_default % "0")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="divide a prompt or output token's positive logit by R, multiply a negative one, "
                   "in (0, 10] (1: off)" + model_default % "1")
    g.add_argument("--presence-penalty", type=float, default=None, metavar="P",
                   help="subtract P from the logit of every token already generated, in [-2, 2] (default: 0)")
    g.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                   help="subtract F times its count from a generated token's logit, in [-2, 2] (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, in [0, 2^63); completion i uses seed + i")
    g.add_argument("--n", type=int, default=1,
                   help="completions generated together in one batch, 1..8; at temperature 0 (the model's or "
                   "--temperature 0) they are sampled at temperature 0.7 instead, as greedy would give n copies "
                   "(--greedy keeps them greedy)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    from fgchat.bench.cli import add_bench_parser
    from fgchat.serve.cli import add_serve_parser

    add_bench_parser(sub)
    add_serve_parser(sub, _add_engine_args)
    return p


def _engine_config(args: argparse.Namespace):
    from fgchat.protocol.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_context=args.max_context,
        mode=args.mode, attention=args.attention, lazy_capture=args.lazy_capture,
        quantize=args.quantize, dequantize=args.dequantize,
        speculate=args.speculate, draft=args.draft, draft_len=args.draft_len,
    )


def _run(args: argparse.Namespace) -> int:
    if args.command in ("generate", "serve") or (args.command is None and args.endpoint is None):
        check_weight_args(args.model, [args.quantize], args.dequantize)
    if args.command != "bench":
        check_spec_args(args.speculate, args.draft, oracle_allowed=args.command == "generate")
    if args.endpoint is not None and args.command is None and args.speculate != "off":
        from fgchat.protocol.errors import FgchatError

        raise FgchatError("speculation runs in the local engine: leave out --endpoint")
    if args.command == "generate":
        from fgchat.generate import run_generate

        return run_generate(args, _engine_config(args))
    if args.command == "bench":
        from fgchat.bench.cli import run_bench

        return run_bench(args)
    if args.command == "serve":
        from fgchat.serve.run import run_serve

        return run_serve(args, _engine_config(args))
    if args.log_csv is not None:
        _check_log_csv(args.log_csv)
    if args.endpoint is not None:
        from fgchat.client.tui import check_endpoint_args, run_endpoint_tui

        check_endpoint_args(args)
        _check_terminal()
        return run_endpoint_tui(args)
    if args.model is not None:  # a path that cannot be a model: one line now, not a failed UI
        from fgchat.engine.model.resolve import check_model_arg

        check_model_arg(args.model)
    _check_terminal()
    from fgchat.tui import run_tui

    return run_tui(
        model=args.model, mode=args.mode, attention=args.attention, max_context=args.max_context,
        log_csv=args.log_csv, device=args.device, dtype=args.dtype, lazy_capture=args.lazy_capture,
        quantize=args.quantize, dequantize=args.dequantize,
        speculate=args.speculate, draft=args.draft, draft_len=args.draft_len,
    )


def _check_log_csv(path: str) -> None:
    """--log-csv's errors (unwritable path, an existing file of another format) come before the
    terminal check: opening it as the chat will shows both kinds; a new file is left uncreated."""
    from pathlib import Path

    check_writable(path, "--log-csv")
    p = Path(path).expanduser()
    if p.is_file() and p.stat().st_size > 0:
        from fgchat.metrics import CsvAppender, new_session_id

        CsvAppender(p, session_id=new_session_id()).close()


def _check_terminal() -> None:
    from fgchat.protocol.errors import FgchatError
    from fgchat.stdio import is_tty

    if not (is_tty(sys.stdin) and is_tty(sys.stdout)):
        raise FgchatError("the chat needs a terminal on stdin and stdout; use `fgchat generate` or "
                          "`fgchat serve` for scripts")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fgchat.engine.bytecode import use_own_pycache

    use_own_pycache()  # before anything imports torch (an install without bytecode)
    from fgchat.protocol.errors import FgchatError
    from fgchat.stdio import one_line, silence_stdout

    try:
        rc = _run(args)
        if sys.stdout is not None:
            write_stdout("")  # a closed pipe or a full disk shows here, not in the flush at exit
        return rc
    except FgchatError as exc:
        print(f"fgchat: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly
        silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt as exc:  # ctrl+c, or generate's SIGTERM / SIGHUP (fgchat.generate.Terminated)
        signum = getattr(exc, "signum", signal.SIGINT)
        how = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        print(f"fgchat: interrupted{how}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
