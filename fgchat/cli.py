"""Command line: the TUI by default; `generate` and `bench` subcommands.

Every user error ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        self.exit(EXIT_USER_ERROR, f"fgchat: error: {message} (see --help)\n")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF repo id, local model directory or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mode", default=None,
                   help="eager | piecewise | full (default: full on CUDA, eager on CPU)")
    p.add_argument("--attention", default="auto", help="auto | triton | flash-attn | torch | sdpa")
    p.add_argument("--max-context", type=int, default=None, help="tokens per sequence slot")
    p.add_argument("--device", default=None, help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--lazy-capture", action="store_true", help="capture each batch size's graphs on first use")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fgchat", description="Terminal chat and latency console with live CUDA-graph modes.")
    _add_engine_args(p)
    p.add_argument("--log-csv", default=None, help="append one row per token to this CSV as it happens")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    g = sub.add_parser("generate", help="headless generation: stream text to stdout, latency summary to stderr")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="system prompt (chat mode)")
    g.add_argument("--raw", action="store_true", help="feed the prompt without the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="completions generated together in one batch (1..8)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    from fgchat.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def _engine_config(args: argparse.Namespace):
    from fgchat.engine.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_context=args.max_context,
        mode=args.mode, attention=args.attention, lazy_capture=args.lazy_capture,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fgchat.engine.errors import FgchatError

    try:
        if args.command == "generate":
            from fgchat.generate import run_generate

            return run_generate(args, _engine_config(args))
        if args.command == "bench":
            from fgchat.bench.cli import run_bench

            return run_bench(args)
        from fgchat.tui import run_tui

        return run_tui(
            model=args.model, mode=args.mode, attention=args.attention, max_context=args.max_context,
            log_csv=args.log_csv, device=args.device, dtype=args.dtype, lazy_capture=args.lazy_capture,
        )
    except FgchatError as exc:
        print(f"fgchat: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("fgchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
