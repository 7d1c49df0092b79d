"""Argument parsing and orchestration for `fgchat bench`.

Every option value is checked before anything is loaded: choices and ranges while parsing, the
combinations and the writability of --json / --csv / --chart at the start of run_bench.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from fgchat.presets import preset_names
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import MODES

BENCH_MODES = tuple(str(m) for m in MODES)
PEERS = ("hf", "hf-eager", "hf-compile")
MAX_OUTLIERS = 6e4  # float16's range


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(not 1 <= v <= 8 for v in vals):
        raise argparse.ArgumentTypeError("batch sizes must be between 1 and 8")
    return vals


def _choice_list(choices: tuple[str, ...], what: str, allow_empty: bool):
    def parse(text: str) -> list[str]:
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {', '.join(map(repr, bad))} (choose from {', '.join(choices)}, comma-separated)")
        if not vals and not allow_empty:
            raise argparse.ArgumentTypeError(f"give at least one {what} ({', '.join(choices)})")
        return vals

    parse.__name__ = f"{what} list"
    return parse


def _preset(text: str) -> str:
    if text not in preset_names():
        raise argparse.ArgumentTypeError(f"unknown preset {text!r} (choose from {', '.join(preset_names())})")
    return text


def _float_in(low: float, high: float, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        ok = (low < value if low_open else low <= value) and value <= high
        if math.isnan(value) or not ok:
            lo = f"> {low:g}" if low_open else f">= {low:g}"
            hi = f" and <= {high:g}" if math.isfinite(high) else ""
            raise argparse.ArgumentTypeError(f"must be {lo}{hi}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def add_bench_parser(sub) -> None:
    from fgchat.cli_args import (
        ATTENTION_BACKENDS,
        DTYPES,
        QUANTIZE,
        SPECULATE_METHODS,
        add_spec_args,
        context_arg,
        device_arg,
        endpoint_arg,
        int_at_least,
        model_arg,
        utf8_text,
    )
    from fgchat.bench.prompt_sets import BUILTIN, RANDOM

    b = sub.add_parser("bench", help="benchmark modes and batch sizes (TTFT, TPOT, ITL, GPU time)",
                       description="Benchmark decode modes and batch sizes on one model: TTFT, TPOT, ITL, "
                       "GPU and launch time per step; optionally transformers peers side by side.")
    b.add_argument("--model", type=model_arg, default=None,
                   help="model to load, as for the chat (default: the embedded model, unless --preset)")
    b.add_argument("--preset", type=_preset, default=None, metavar="NAME",
                   help=f"shape preset (a model's config.json shipped with fgchat), with --random-weights: "
                        f"{', '.join(preset_names())} "
                   "(default: none)")
    b.add_argument("--random-weights", action="store_true", help="random weights of the preset's shape")
    b.add_argument("--quantize", type=_choice_list(QUANTIZE, "format", False), default="none", metavar="LIST",
                   help="comma-separated weight formats to measure, one set of rows each, from "
                   f"{', '.join(QUANTIZE)}: fp8 and int4 quantize a bf16/fp16 model's projections at load "
                   "(rows labelled fgchat-MODE-FORMAT)")
    b.add_argument("--dequantize", action="store_true",
                   help="a GGUF file's weights dequantized to bf16 at load (the unquantized path, to compare)")
    b.add_argument("--outliers", type=_float_in(0.0, MAX_OUTLIERS), default=0.0, metavar="VALUE",
                   help="with --random-weights: massive activation channels up to VALUE (0..60000) in the "
                        "residual stream, as real models carry them (e.g. 2.5e4; default 0: none)")
    b.add_argument("--penalties", action="store_true",
                   help="greedy with repetition 1.1, presence 0.5 and frequency 0.25 penalties "
                        "(their cost per step; default: plain greedy)")
    b.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.0, metavar="T",
                   help="sample at temperature T (request i with seed i; default 0: greedy); fgchat only")
    b.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="with --temperature: top-k filtering (K > 0 sorts the logits each step; default 0: off)")
    b.add_argument("--modes", type=_choice_list(BENCH_MODES, "mode", False), default="eager,piecewise,full",
                   metavar="LIST", help=f"comma-separated decode modes to run, from {', '.join(BENCH_MODES)}")
    b.add_argument("--batch-sizes", type=_int_list, default="1,2,4,8", metavar="LIST",
                   help="comma-separated batch sizes, each 1..8")
    b.add_argument("--prompts", type=utf8_text, default=RANDOM, metavar="SET",
                   help=f"{RANDOM}: random token prompts of --prompt-len; {' or '.join(BUILTIN)} (built-in chat "
                   "prompts: input to repeat or edit, or nothing to look up) or a UTF-8 text file of prompts, "
                   "one per blank-line-separated block: user messages in the model's chat template, batch B "
                   "takes prompts 1..B, requests stop at end of sequence (default: random)")
    b.add_argument("--prompt-len", type=int_at_least(1), default=512, metavar="TOKENS",
                   help="prompt tokens per request, >= 1 (with --prompts random)")
    b.add_argument("--output-len", type=int_at_least(2), default=128, metavar="TOKENS",
                   help="generated tokens per request, >= 2 (with a --prompts set: at most)")
    b.add_argument("--warmup", type=int_at_least(0), default=1, metavar="N",
                   help="untimed warm-up runs per batch size, >= 0")
    b.add_argument("--repeats", type=int_at_least(1), default=3, metavar="N",
                   help="timed runs per batch size, >= 1")
    b.add_argument("--peers", type=_choice_list(PEERS, "peer", True), default="", metavar="LIST",
                   help="peers run side by side: hf (= hf-eager,hf-compile), hf-eager, hf-compile "
                   "(default: none)")
    b.add_argument("--peer-timeout", type=_float_in(0.0, math.inf, low_open=True), default=420.0,
                   metavar="SECONDS",
                   help="time budget per peer, checked between generate calls; past it the rest of that peer "
                        "is marked skipped and the run goes on")
    b.add_argument("--json", default=None, metavar="PATH",
                   help="write full records as JSON here (checked for writability before the run; "
                   "default: not written)")
    b.add_argument("--csv", default=None, metavar="PATH",
                   help="write one row per (runner, batch size) here (checked for writability before the "
                   "run; default: not written)")
    b.add_argument("--chart", default=None, metavar="PATH",
                   help="write an SVG bar chart of ms per decode step by batch size and runner here after "
                   "the run (checked for writability before it; default: not written)")
    b.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="with --chart: draw the chart from these `--json` results instead of running "
                   "(one panel per model; the other options are not used; default: run)")
    b.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS, help="decode-attention backend")
    add_spec_args(b, _choice_list(SPECULATE_METHODS, "method", False))
    b.add_argument("--device", type=device_arg, default=None,
                   help="auto | cpu | cuda | cuda:N (default: auto, CUDA when available)")
    b.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weight and cache dtype (default: auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32)")
    b.add_argument("--max-context", type=context_arg, default=None, metavar="TOKENS",
                   help="tokens per sequence slot, >= prompt-len + output-len + 8 "
                   "(default: just that much)")
    b.add_argument("--no-progress", action="store_true",
                   help="no progress bars (ours, transformers' and huggingface_hub's)")
    b.add_argument("--endpoint", type=endpoint_arg, default=None, metavar="URL",
                   help="measure an OpenAI-compatible server instead (e.g. http://127.0.0.1:8000/v1): batch size "
                   "B = B concurrent streams, timed at the client; --model names the served model (default: "
                   "its first), --prompt-len counts words")
    b.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --endpoint: Bearer key for the server (default: $FGCHAT_API_KEY, else none)")


def silence_progress_bars() -> None:
    """Turn off transformers' and huggingface_hub's tqdm bars (e.g. "Loading weights") for this
    process. The environment variable covers later imports; modules already imported are told directly."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def check_bench_args(args: argparse.Namespace) -> None:
    """The checks that involve several options or the file system; each failure is one line."""
    from fgchat.cli_args import check_writable

    if getattr(args, "endpoint", None):
        from fgchat.bench.endpoint import check_endpoint_bench_args

        check_endpoint_bench_args(args)
    if args.preset and not args.random_weights:
        raise FgchatError("--preset needs --random-weights (presets carry shapes, not weights)")
    if args.random_weights and not args.preset:
        raise FgchatError("--random-weights needs --preset NAME")
    if args.preset and args.model:
        raise FgchatError("give --model or --preset with --random-weights, not both")
    if args.outliers and not args.random_weights:
        raise FgchatError("--outliers needs --random-weights")
    if not getattr(args, "endpoint", None):
        from fgchat.cli_args import check_weight_args

        check_weight_args(args.model, args.quantize, args.dequantize, args.preset)
    if args.temperature > 0 and (args.peers or getattr(args, "endpoint", None)):
        raise FgchatError("--temperature measures fgchat's own sampled steps: leave out --peers and --endpoint")
    check_bench_spec_args(args)
    if args.top_k and not args.temperature > 0:
        raise FgchatError("--top-k needs --temperature above 0")
    check_prompt_set_args(args)
    need = args.prompt_len + args.output_len + 8
    if getattr(args, "prompts", "random") == "random" and args.max_context is not None and args.max_context < need:
        raise FgchatError(f"--max-context {args.max_context} is too small for --prompt-len + --output-len "
                          f"(needs {need} tokens)")
    outputs = [("--json", args.json), ("--csv", args.csv), ("--chart", args.chart)]
    for option, path in outputs:
        if path is not None:
            check_writable(path, option, replace=True)
    named = [(option, Path(path).expanduser().resolve()) for option, path in outputs if path is not None]
    for i, (option, path) in enumerate(named):
        for other, other_path in named[i + 1:]:
            if path == other_path:
                raise FgchatError(f"{option} and {other} name the same file")


def check_bench_spec_args(args: argparse.Namespace) -> None:
    """--speculate LIST with --draft: check_spec_args for each method."""
    from fgchat.cli_args import check_spec_args

    methods = speculation_args(args)["speculate"]
    for method in methods:
        check_spec_args(method, args.draft if method == "draft" else None, oracle_allowed=True)
    if "draft" not in methods:
        check_spec_args(methods[0], args.draft, oracle_allowed=True)  # a --draft no method uses
    if any(m != "off" for m in methods) and getattr(args, "endpoint", None):
        raise FgchatError("speculation runs in the local engine: leave out --endpoint")


def check_prompt_set_args(args: argparse.Namespace) -> None:
    """A --prompts set: readable and non-empty, on the local engine with a tokenizer, without peers."""
    from fgchat.bench.prompt_sets import RANDOM, check_has_tokenizer, prompt_texts

    name = getattr(args, "prompts", RANDOM)
    if name == RANDOM:
        return
    prompt_texts(name)  # the file's own failures first
    check_has_tokenizer(name, args.random_weights)
    for option, given in (("--endpoint", getattr(args, "endpoint", None)), ("--peers", args.peers)):
        if given:
            raise FgchatError(f"--prompts {name} runs on fgchat's own engine: leave out {option}")


def check_chart_args(args: argparse.Namespace) -> None:
    """--from-json draws existing results: it needs --chart, and writes no run output."""
    from fgchat.cli_args import check_writable

    if args.chart is None:
        raise FgchatError("--from-json needs --chart PATH (the SVG to write)")
    for option, given in (("--json", args.json), ("--csv", args.csv), ("--endpoint", args.endpoint)):
        if given is not None:
            raise FgchatError(f"--from-json draws existing results and runs nothing: leave out {option}")
    check_writable(args.chart, "--chart", replace=True)
    chart = Path(args.chart).expanduser().resolve()
    if any(Path(p).expanduser().resolve() == chart for p in args.from_json):
        raise FgchatError(f"--chart {args.chart} is one of the --from-json files")


def write_chart(results: list[dict], path: str | Path) -> None:
    """Render results as the SVG chart at `path` (atomically)."""
    from fgchat.bench.chart import bar_chart_svg
    from fgchat.metrics.csv_export import atomic_write_text

    atomic_write_text(Path(path).expanduser(), bar_chart_svg(results))


def run_chart(args: argparse.Namespace) -> int:
    check_chart_args(args)
    from fgchat.bench.chart import load_results

    write_chart(load_results(args.from_json), args.chart)
    print(f"chart written to {args.chart}")
    return 0


def write_outputs(result: dict, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Writes every requested result file, whatever became of the others. Returns the lines for
    stdout (files written) and the error messages, one per file not written."""
    from fgchat.bench.report import write_csv, write_json

    def chart(r: dict, path: Path) -> None:
        write_chart([r], path)

    written, failed = [], []
    for option, path, write in (("--json", args.json, write_json), ("--csv", args.csv, write_csv),
                                ("--chart", args.chart, chart)):
        if not path:
            continue
        try:
            write(result, Path(path).expanduser())
        except FgchatError as e:  # the atomic writer's one line names the file
            failed.append(f"{option}: {e}")
        except OSError as e:  # e.g. the disk filled up during the run
            failed.append(f"cannot write {option} {path}: {e.strerror or e}")
        else:
            if option == "--chart":
                written.append(f"chart written to {path}")
    return written, failed


def speculation_args(args: argparse.Namespace) -> dict:
    """BenchSpec's speculate / draft / draft_len from the parsed flags (a LIST or a list of names)."""
    methods = getattr(args, "speculate", None) or ["off"]
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    out: dict = {"speculate": list(dict.fromkeys(methods)), "draft": getattr(args, "draft", None)}
    if getattr(args, "draft_len", None) is not None:
        out["draft_len"] = int(args.draft_len)
    return out


def run_bench(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        return run_chart(args)
    check_bench_args(args)
    if args.no_progress:
        silence_progress_bars()  # before the runner imports transformers
    from fgchat.bench.report import print_report
    from fgchat.bench.runner import BenchSpec, run_all
    from fgchat.stdio import one_line, silence_stdout

    spec = BenchSpec(
        model=args.model, preset=args.preset, modes=list(args.modes), batch_sizes=args.batch_sizes,
        prompts=args.prompts, prompt_len=args.prompt_len, output_len=args.output_len, warmup=args.warmup,
        repeats=args.repeats, peers=list(args.peers), attention=args.attention, device=args.device,
        dtype=args.dtype, max_context=args.max_context, progress=not args.no_progress,
        peer_timeout=args.peer_timeout, outliers=args.outliers, penalties=args.penalties,
        temperature=args.temperature, top_k=max(args.top_k, 0),
        quantize=list(dict.fromkeys(args.quantize)), dequantize=args.dequantize,
        **speculation_args(args),
    )
    if args.endpoint:
        from fgchat.bench.endpoint import run_endpoint_bench

        result = run_endpoint_bench(args)
    else:
        result = run_all(spec)
    if not result["runs"]:  # existing result files stay as they are
        reasons = "; ".join(f"{s['runner']}: {s['reason']}" for s in result["skipped"]) or "none was measured"
        raise FgchatError(f"no requested mode could run here: {reasons}")
    interrupted = bool(result["meta"].get("interrupted"))
    # the files come first: a stdout that fails (closed pipe, full disk) cannot lose them
    written, failed = write_outputs(result, args)
    try:
        print_report(result, sys.stdout)
        for line in written:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        if not failed and not interrupted:
            raise  # the reader went away (`| head`): main stops quietly
        silence_stdout()
    except OSError as e:
        silence_stdout()
        failed.append(f"cannot write the report to stdout: {e.strerror or e}")
    if interrupted:
        for message in failed:
            print(f"fgchat: error: {one_line(message)}", file=sys.stderr)
        raise KeyboardInterrupt  # main says "interrupted" and exits 130
    if failed:
        raise FgchatError("; ".join(failed))
    return 0
