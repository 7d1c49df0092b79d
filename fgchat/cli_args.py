"""Option types and checks shared by every command line (fgchat, its subcommands and `fgchat
serve`): each turns a bad value into one argparse error line before anything is loaded."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ATTENTION_BACKENDS = ("auto", "triton", "flash-attn", "torch", "sdpa")  # fgchat.engine.kernels.attention
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")  # fgchat.engine.devices
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
QUANTIZE = ("none", "fp8", "int4")  # fgchat.engine.quant.qweight.QUANTIZE_FORMATS, and none
MIN_CONTEXT = 16
STDOUT_CLOSED = "stdout is closed: nowhere to write the output"


def utf8_text(text: str) -> str:
    """Text that must be valid UTF-8: undecodable bytes from the shell arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {bad!a}"
        raise argparse.ArgumentTypeError(f"not valid UTF-8 ({byte} at position {e.start})") from None
    return text


def model_arg(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty model name (give a model directory, a .gguf file or a Hugging Face repo id; "
            "leave --model out for the embedded model)")
    return text


def device_arg(text: str) -> str:
    if not DEVICE_RE.match(text.strip()):
        raise argparse.ArgumentTypeError(f"invalid device {text!r} (choose from auto, cpu, cuda, cuda:N)")
    return text.strip()


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


context_arg = int_at_least(MIN_CONTEXT)


def endpoint_arg(text: str) -> str:
    """An http(s) base URL of an OpenAI-compatible server (fgchat.client.base_url normalises it)."""
    from fgchat.client.urls import base_url

    try:
        return base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def is_gguf_model(model: str | None) -> bool:
    """Whether --model names a GGUF file: a .gguf path, or none (the embedded model's GGUF)."""
    return model is None or model.strip().lower().endswith(".gguf")


def check_weight_args(model: str | None, quantize: Sequence[str], dequantize: bool,
                      preset: str | None = None) -> None:
    """--quantize is for float checkpoints, --dequantize for GGUF files: a quantized file is never
    quantized again, and --dequantize with anything but a GGUF file is a one-line error."""
    from fgchat.protocol.errors import FgchatError

    gguf = preset is None and is_gguf_model(model)
    asked = [q for q in quantize if q != "none"]
    if gguf and asked:
        name = "the embedded model's GGUF file" if model is None else model
        raise FgchatError(f"--quantize {asked[0]}: {name} is already quantized; --dequantize runs it in bf16"
                          + (" (without --quantize)" if dequantize else ""))
    if dequantize and not gguf:
        what = "--random-weights makes unquantized weights" if preset else f"{model} is not one"
        raise FgchatError(f"--dequantize applies to GGUF files; {what}")


def check_writable(path: str, option: str, replace: bool = False) -> None:
    """Fail now, not after a long run, when `path` cannot be written: the file is opened for append
    (as --log-csv will) and removed again if this call created it. replace: the file will be written
    atomically (a temporary file in the same directory, then renamed), so the directory must take a
    new file too."""
    from fgchat.protocol.errors import FgchatError

    p = Path(path).expanduser()
    if not path.strip():
        raise FgchatError(f"{option}: empty path")
    if p.is_dir():
        raise FgchatError(f"cannot write {option} {path}: is a directory")
    if not p.parent.is_dir():
        raise FgchatError(f"cannot write {option} {path}: directory {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise FgchatError(f"cannot write {option} {path}: {e.strerror or e}") from None
    if not existed:
        try:
            os.unlink(p)
        except OSError:
            pass
    if replace:
        import tempfile

        try:
            with tempfile.NamedTemporaryFile(dir=p.parent, prefix=f".{p.name}.", suffix=".check"):
                pass
        except OSError as e:
            raise FgchatError(f"cannot write {option} {path}: directory {p.parent}: {e.strerror or e}") from None


def write_stdout(text: str) -> None:
    """Write `text` to stdout and flush ("" only flushes). BrokenPipeError propagates (the reader
    went away: the caller stops quietly); a closed stdout or any other write error is one
    FgchatError line, and stdout then points at devnull, so the flush at exit cannot fail again."""
    from fgchat.protocol.errors import FgchatError
    from fgchat.stdio import silence_stdout

    if sys.stdout is None:
        raise FgchatError(STDOUT_CLOSED)
    try:
        if text:
            sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        silence_stdout()
        raise FgchatError(f"cannot write to stdout: {e.strerror or e}") from None


SPECULATE_METHODS = ("off", "ngram", "draft", "oracle")  # engine.speculate.METHODS (torch-free here)


def draft_len_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid draft length: {text!r}") from None
    if not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"draft length must be in 1..8, got {value}")
    return value


def add_spec_args(p: argparse.ArgumentParser, methods: Callable[[str], list[str]] | None = None) -> None:
    """--speculate, --draft, --draft-len (checked together by check_spec_args). methods: the type
    that reads --speculate as a comma-separated LIST (bench: rows per method); else one choice."""
    what = ("speculative decoding: ngram (prompt lookup), draft (a smaller model, --draft), "
            "oracle (benchmarks: an earlier greedy run's tokens; bench and generate only)")
    if methods is None:
        p.add_argument("--speculate", default="off", choices=SPECULATE_METHODS, help=what)
    else:
        p.add_argument("--speculate", default="off", type=methods, metavar="LIST",
                       help=f"comma-separated methods, one set of rows each (off: plain decoding); {what}")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="with --speculate draft: the draft model (same tokenizer; preset:NAME for random weights)")
    p.add_argument("--draft-len", type=draft_len_arg, default=4, metavar="K",
                   help="drafted tokens per step at most, 1..8 (adaptive below it; default: 4)")


def check_spec_args(speculate: str, draft: str | None, oracle_allowed: bool) -> None:
    """The speculation options together; each failure is one line."""
    from fgchat.protocol.errors import FgchatError

    if draft is not None and speculate != "draft":
        raise FgchatError("--draft needs --speculate draft")
    if speculate == "draft" and not draft:
        raise FgchatError("--speculate draft needs --draft MODEL")
    if speculate == "oracle" and not oracle_allowed:
        raise FgchatError("--speculate oracle is for `fgchat bench` and `fgchat generate`")
