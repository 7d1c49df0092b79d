"""Bad input at the command line: one line on stderr (`fgchat: error: ...`), exit status 2, never a
traceback. Most cases run `fgchat.cli.main` in-process and fail before any model is loaded."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tiny_models
from fgchat.cli import main

TUI: list[str] = []
GEN = ["generate", "--prompt", "hi"]
BENCH = ["bench"]
NO_DIR = "/nonexistent-fgchat-dir/out.csv"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_models.build_model(tmp_path_factory.mktemp("cli_bad_input") / "llama", "llama")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run_main(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err: str, needle: str) -> str:
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("fgchat: error:"), lines[0]
    assert needle in lines[0], lines[0]
    return lines[0]


# Options every entry shares (the TUI, generate and bench): (args, needle in the error line)
ENGINE_CASES = [
    (["--mode", "bogus"], "--mode: invalid choice: 'bogus'"),
    (["--mode", ""], "--mode: invalid choice"),
    (["--attention", "bogus"], "--attention: invalid choice: 'bogus'"),
    (["--dtype", "half"], "--dtype: invalid choice: 'half'"),
    (["--device", "meta"], "--device: invalid device 'meta'"),
    (["--device", "mps"], "--device: invalid device"),
    (["--device", "cuda:x"], "--device: invalid device"),
    (["--device", "cuda:-1"], "--device: invalid device"),
    (["--device", ""], "--device: invalid device"),
    (["--max-context", "-5"], "--max-context: must be >= 16, got -5"),
    (["--max-context", "0"], "--max-context: must be >= 16"),
    (["--max-context", "8"], "--max-context: must be >= 16"),
    (["--max-context", "1e9"], "--max-context: invalid int value"),
    (["--max-context", "abc"], "--max-context: invalid int value"),
    (["--model", ""], "--model: empty model name"),
    (["--model", "   "], "--model: empty model name"),
    (["--model"], "--model: expected one argument"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
]
TUI_CASES = [
    (["--lazy-capture=yes"], "--lazy-capture: ignored explicit argument"),
    (["--log-csv", NO_DIR], "cannot write --log-csv"),
    (["--log-csv", "/"], "is a directory"),
    (["--log-csv", ""], "--log-csv: empty path"),
    (["nonsense-command"], "invalid choice: 'nonsense-command'"),
    # a model path that cannot load: said before the chat starts (and before the terminal check)
    (["--model", "./models/nope"], "model path not found: ./models/nope"),
    (["--model", "/nonexistent-fgchat-dir/model.gguf"], "model path not found: /nonexistent-fgchat-dir/model.gguf"),
    (["--model", __file__], "unsupported model file"),
    (["--model", str(Path(__file__).parent)], "not a model directory (no config.json)"),
]
GEN_CASES = [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", "\udcff"], "--prompt: not valid UTF-8 (byte 0xff at position 0)"),
    (["--prompt", "ok \udcc3("], "--prompt: not valid UTF-8 (byte 0xc3 at position 3)"),
    (["--system", "\udcfe"], "--system: not valid UTF-8"),
    (["--max-tokens", "0"], "max tokens must be >= 1"),
    (["--max-tokens", "ten"], "--max-tokens: invalid int value"),
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "101"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-k", "-3"], "top-k"),
    (["--seed", "-1"], "seed"),
    (["--seed", str(2**63)], "seed"),
    (["--n", "0"], "--n must be between 1 and 8"),
    (["--n", "9"], "--n must be between 1 and 8"),
    (["--raw=1"], "--raw: ignored explicit argument"),
    (["--json=1"], "--json: ignored explicit argument"),
    (["--log-csv", "x.csv"], "unrecognized arguments"),
    # these get as far as resolving the model (offline), still before loading anything
    (["--model", "models/nope"], "model 'models/nope' is not a local path (no such file or directory) "
                                 "and not a reachable Hugging Face repo: "),
    (["--model", "./models/nope"], "model path not found: ./models/nope"),
    (["--model", "bad\nname.gguf"], "model path not found: bad\\nname.gguf"),
]
BENCH_CASES = [
    (["--preset", "gpt5", "--random-weights"], "--preset: unknown preset 'gpt5' (choose from "),
    (["--random-weights"], "--random-weights needs --preset"),
    (["--preset", "tiny"], "--preset needs --random-weights"),
    (["--preset", "tiny", "--random-weights", "--model", "x"], "not both"),
    (["--outliers", "-1"], "--outliers: must be >= 0 and <= 60000"),
    (["--outliers", "1e9"], "--outliers: must be >= 0 and <= 60000"),
    (["--outliers", "nan"], "--outliers: must be"),
    (["--outliers", "5"], "--outliers needs --random-weights"),
    (["--modes", "turbo"], "--modes: invalid choice: 'turbo'"),
    (["--modes", "eager,bogus"], "--modes: invalid choice: 'bogus'"),
    (["--modes", ","], "--modes: give at least one mode"),
    (["--batch-sizes", "0"], "--batch-sizes: batch sizes must be between 1 and 8"),
    (["--batch-sizes", "1,x"], "--batch-sizes: expected comma-separated integers"),
    (["--batch-sizes", "16"], "--batch-sizes"),
    (["--prompt-len", "0"], "--prompt-len: must be >= 1"),
    (["--output-len", "1"], "--output-len: must be >= 2"),
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--repeats", "1.5"], "--repeats: invalid int value"),
    (["--peers", "vllm"], "--peers: invalid choice: 'vllm'"),
    (["--peer-timeout", "0"], "--peer-timeout: must be > 0"),
    (["--peer-timeout", "-3"], "--peer-timeout: must be > 0"),
    (["--peer-timeout", "nan"], "--peer-timeout: must be > 0"),
    (["--json", "/"], "cannot write --json /: is a directory"),
    (["--json", NO_DIR], "cannot write --json"),
    (["--csv", NO_DIR], "cannot write --csv"),
    (["--csv", "/"], "is a directory"),
    (["--max-context", "100"], "--max-context 100 is too small"),
    (["--no-progress=1"], "--no-progress: ignored explicit argument"),
    (["--mode", "bogus"], "ambiguous option: --mode could match --model, --modes"),
    (["--temperature", "-1"], "--temperature: must be >= 0"),
    (["--temperature", "0.7", "--peers", "hf"], "--temperature measures fgchat's own sampled steps"),
    (["--top-k", "50"], "--top-k needs --temperature above 0"),
]

CASES = (
    [pytest.param(TUI + a, n, id="tui " + " ".join(a)) for a, n in ENGINE_CASES + TUI_CASES]
    + [pytest.param(GEN + a, n, id="generate " + " ".join(a)) for a, n in ENGINE_CASES + GEN_CASES]
    + [pytest.param(BENCH + a, n, id="bench " + " ".join(a))
       for a, n in [c for c in ENGINE_CASES if c[0][0] != "--mode"] + BENCH_CASES]
)


@pytest.mark.parametrize("argv,needle", CASES)
def test_bad_option_is_one_line(capsys, argv, needle):
    rc, out, err = run_main(capsys, argv)
    assert_one_line_error(rc, err, needle)
    assert out == ""


def test_missing_prompt_is_one_line(capsys):
    rc, _, err = run_main(capsys, ["generate"])
    assert_one_line_error(rc, err, "the following arguments are required: --prompt")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(capsys, tiny):
    rc, _, err = run_main(capsys, GEN + ["--model", str(tiny), "--device", "cuda:0"])
    assert_one_line_error(rc, err, "no CUDA device is available")


def test_pick_device_rejects_other_torch_devices():
    import torch

    from fgchat.protocol.errors import FgchatError
    from fgchat.engine.devices import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(None).type in ("cpu", "cuda")
    for bad in ("meta", "mps", "xla", "cuda:x", "cpu:0", "cuda,cpu"):
        with pytest.raises(FgchatError, match="unknown device"):
            pick_device(bad)


def test_empty_model_is_not_the_embedded_model():
    from fgchat.protocol.errors import ModelLoadError
    from fgchat.engine.model.resolve import resolve_model

    with pytest.raises(ModelLoadError, match="empty model name"):
        resolve_model("")


def test_hub_message_without_a_path_reading(monkeypatch):
    """download_snapshot called for a repo id alone keeps the plain hub message."""
    from fgchat.protocol.errors import ModelLoadError
    from fgchat.engine.model.resolve import download_snapshot

    with pytest.raises(ModelLoadError) as e:
        download_snapshot("fgchat-test/does-not-exist")
    assert str(e.value).startswith("model 'fgchat-test/does-not-exist' is not in the local Hugging Face cache")


# ---------------------------------------------------------------------------- max context note
def test_max_context_note_says_capped():
    from fgchat.engine.kv_cache import choose_max_context
    from fgchat.engine.loader import load_preset_config
    from fgchat.engine.model.config import parse_config

    import torch

    cfg = parse_config(load_preset_config("tiny"))  # max_position_embeddings 2048
    cpu, f32 = torch.device("cpu"), torch.float32
    assert choose_max_context(cfg, f32, cpu, 10**9, 1 << 40) == (
        2048, "requested 1000000000, capped to the model's maximum 2048")
    assert choose_max_context(cfg, f32, cpu, 512, 1 << 40) == (512, "requested")
    assert choose_max_context(cfg, f32, cpu, None, 1 << 40) == (2048, "model default")
    n, why = choose_max_context(cfg, f32, cpu, 2048, 0)
    assert n == 256 and why == "requested 2048, capped by cpu memory to 256 (model allows 2048)"


def test_max_context_note_in_generate(capsys, tiny):
    rc, out, err = run_main(capsys, GEN + ["--model", str(tiny), "--max-tokens", "2", "--raw",
                                           "--max-context", "1000000000", "--device", "cpu"])
    assert rc == 0, err
    assert "max context 2048 tokens (requested 1000000000, capped to the model's maximum 2048)" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- config.json values
CONFIG_CASES = [
    ("hidden_size", 0, "hidden_size"),
    ("hidden_size", -64, "hidden_size"),
    ("hidden_size", "64", "hidden_size must be an integer"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("num_attention_heads", -4, "num_attention_heads"),
    ("num_key_value_heads", 0, "num_key_value_heads"),
    ("num_key_value_heads", -2, "num_key_value_heads"),
    ("num_key_value_heads", 3, "num_key_value_heads"),  # 4 heads are not a multiple of 3
    ("intermediate_size", 0, "intermediate_size"),
    ("intermediate_size", -128, "intermediate_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("num_hidden_layers", 2.5, "num_hidden_layers"),
    ("vocab_size", 0, "vocab_size"),
    ("vocab_size", -384, "vocab_size"),
    ("head_dim", 0, "head_dim"),
    ("head_dim", -16, "head_dim"),
    ("head_dim", 15, "head_dim must be even"),
    ("rope_theta", 0, "rope_theta"),
    ("rope_theta", -10000.0, "rope_theta"),
    ("rope_theta", math.nan, "rope_theta"),
    ("rope_parameters", {"rope_theta": 0.0, "rope_type": "default"}, "rope_parameters.rope_theta"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                      "original_max_position_embeddings": 8192}, "rope_scaling.high_freq_factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, "rope_scaling.low_freq_factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 0}, "rope_scaling.original_max_position_embeddings"),
    ("rope_parameters", {"rope_theta": 1e4, "rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "rope_parameters.factor"),
    ("max_position_embeddings", 0, "max_position_embeddings"),
    ("max_position_embeddings", -2048, "max_position_embeddings"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps"),
    ("sliding_window", -1, "sliding_window"),
]


def _corrupt(src: Path, dst: Path, field: str, value) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg[field] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field,value,needle", CONFIG_CASES,
                         ids=[f"{f}={v!r}"[:60] for f, v, _ in CONFIG_CASES])
def test_bad_config_value_is_one_line(tmp_path, tiny, field, value, needle):
    import torch

    from fgchat.protocol.errors import ModelLoadError
    from fgchat.engine.loader import load_model

    d = _corrupt(tiny, tmp_path / "m", field, value)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d), torch.device("cpu"), torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("invalid config.json: "), msg
    assert needle in msg, msg


def test_hidden_size_not_divisible_without_head_dim(tmp_path, tiny):
    from fgchat.protocol.errors import ModelLoadError
    from fgchat.engine.model.config import parse_config

    raw = json.loads((tiny / "config.json").read_text())
    raw.pop("head_dim")
    raw["hidden_size"] = 66
    with pytest.raises(ModelLoadError, match="hidden_size .66. must be divisible by num_attention_heads"):
        parse_config(raw)


def test_bad_config_through_the_cli(capsys, tmp_path, tiny):
    d = _corrupt(tiny, tmp_path / "m", "num_key_value_heads", 0)
    rc, _, err = run_main(capsys, GEN + ["--model", str(d)])
    assert_one_line_error(rc, err, "num_key_value_heads must be >= 1, got 0")


def test_presets_still_parse():
    from fgchat.bench.cli import preset_names
    from fgchat.engine.loader import load_preset_config
    from fgchat.engine.model.config import parse_config, rope_inv_freq

    for name in preset_names():
        cfg = parse_config(load_preset_config(name))
        assert all(math.isfinite(f) and f > 0 for f in rope_inv_freq(cfg)), name


# ---------------------------------------------------------------------------- out of memory
def _oom_errors():
    import torch

    return [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
                     "you tried to allocate 1073741824 bytes."),
    ]


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("where", ["place", "read"])
def test_out_of_memory_while_loading_is_one_line(monkeypatch, capsys, tiny, case, where):
    from fgchat.engine import loader

    error = _oom_errors()[case]

    def boom(*a, **k):
        raise error

    if where == "place":
        monkeypatch.setattr(loader, "weights_from_state_dict", boom)
    else:  # safetensors reading the file into host memory
        monkeypatch.setattr("safetensors.torch.load_file", boom)
    rc, _, err = run_main(capsys, GEN + ["--model", str(tiny), "--device", "cpu"])
    line = assert_one_line_error(rc, err, "memory to load model")
    assert tiny.name in line and "CPU memory" in line


def test_out_of_memory_for_the_kv_cache(monkeypatch):
    import torch

    from fgchat.protocol.errors import FgchatError
    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.loader import load_preset_config
    from fgchat.engine.model.config import parse_config

    cfg = parse_config(load_preset_config("tiny"))

    def boom(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(torch, "empty", boom)
    with pytest.raises(FgchatError, match="not enough cpu memory for a KV cache of 512 tokens"):
        KVCache(cfg, 512, torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------------------- --version, --help
def test_version(capsys):
    from importlib.metadata import version

    rc, out, err = run_main(capsys, ["--version"])
    assert rc == 0 and err == ""
    assert out == f"fgchat {version('fgchat')}\n"


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"]])
def test_help_states_every_default(capsys, argv):
    rc, out, _ = run_main(capsys, argv)
    assert rc == 0
    options = out.split("options:", 1)[1]
    blocks: list[str] = []
    for line in options.splitlines():
        if line.startswith("  -"):
            blocks.append(line)
        elif blocks and line.startswith("   "):
            blocks[-1] += " " + line.strip()
    assert len(blocks) > 8
    for block in blocks:
        if block.lstrip().startswith(("-h", "--version")):
            continue
        if block.split()[0] == "--prompt":
            assert "(required)" in block
            continue
        words = block.split()
        assert len(words) > 2, f"no help text: {block}"
        assert "default" in block, f"no default in: {block}"


def test_help_shows_the_default_values(capsys):
    _, out, _ = run_main(capsys, ["bench", "--help"])
    text = " ".join(out.split())
    assert "(default: 1,2,4,8)" in text and "(default: 512)" in text and "(default: eager,piecewise,full)" in text
    _, out, _ = run_main(capsys, ["generate", "--help"])
    text = " ".join(out.split())
    assert "(default: 256)" in text and "(default: auto)" in text and "(default: off)" in text


# ---------------------------------------------------------------------------- bench: up-front checks
@pytest.fixture
def no_run(monkeypatch):
    """run_all must not be reached; when it is, the test sees a one-line error naming it."""
    from fgchat.bench import runner
    from fgchat.protocol.errors import FgchatError

    calls = []

    def fake(spec):
        calls.append(spec)
        raise FgchatError("run_all reached")

    monkeypatch.setattr(runner, "run_all", fake)
    return calls


BENCH_OK = ["bench", "--preset", "tiny", "--random-weights", "--batch-sizes", "1", "--prompt-len", "8",
            "--output-len", "2", "--repeats", "1", "--warmup", "0"]


def test_bench_unwritable_output_fails_before_running(capsys, tmp_path, no_run):
    for opt in ("--json", "--csv"):
        rc, _, err = run_main(capsys, BENCH_OK + [opt, str(tmp_path)])
        assert_one_line_error(rc, err, f"cannot write {opt} {tmp_path}: is a directory")
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        rc, _, err = run_main(capsys, BENCH_OK + [opt, str(blocker / "out.json")])
        assert_one_line_error(rc, err, "does not exist")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        target = ro / "out.json" if not os.access(ro, os.W_OK) else Path("/sys/fgchat-test-out.json")
        rc, _, err = run_main(capsys, BENCH_OK + ["--json", str(target)])
        assert_one_line_error(rc, err, f"cannot write --json {target}")
    finally:
        ro.chmod(0o700)
    assert no_run == []


def test_bench_writable_output_is_left_as_it_was(capsys, tmp_path, no_run):
    new, old = tmp_path / "new.json", tmp_path / "old.csv"
    old.write_text("keep me\n")
    rc, _, err = run_main(capsys, BENCH_OK + ["--json", str(new), "--csv", str(old)])
    assert_one_line_error(rc, err, "run_all reached")  # the checks passed and the run started
    assert not new.exists() and old.read_text() == "keep me\n"
    assert len(no_run) == 1


def test_bench_no_progress_silences_hf_bars(capsys, monkeypatch, no_run):
    import huggingface_hub.utils as hf_utils
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    was = hf_logging.is_progress_bar_enabled()
    try:
        rc, _, err = run_main(capsys, BENCH_OK)
        assert rc == 2 and hf_logging.is_progress_bar_enabled() == was  # no --no-progress: untouched
        rc, _, err = run_main(capsys, BENCH_OK + ["--no-progress"])
        assert_one_line_error(rc, err, "run_all reached")
        assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1"
        assert not hf_logging.is_progress_bar_enabled()
        assert hf_utils.are_progress_bars_disabled()
        assert no_run[-1].progress is False
    finally:
        if was:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------- stdout: pipes and TTYs
PIECES = ["Hello ", "\x1b[31", "mred\x1b[0m", " \x1b]0;pwned\x07ok", " \x1b]52;c;Zm9v\x1b", "\\end\r\n",
          "bell\x07\x08 ", "\x9b2Jclear ", "\x1b7saved ", "é 東京\ttab", "\x1b(Bcharset "]
CLEAN = "Hello red ok end\nbell clear saved é 東京\ttabcharset "


class FakeEngine:
    """Engine stand-in for run_generate: streams PIECES as tokens, one per step."""

    instances: list[FakeEngine] = []

    def __init__(self, config):
        self.tokenizer = SimpleNamespace(apply_chat_template=lambda m, add_generation_prompt: [1, 2],
                                         encode=lambda t, add_special_tokens: [1, 2])
        self.model = SimpleNamespace(name="fake")
        self.mode, self.device, self.startup_check = "eager", "cpu", None
        self.pieces = list(PIECES)
        self.sent: list[str] = []
        self.cancelled = False
        self.finished = False
        FakeEngine.instances.append(self)

    def submit(self, prompt, params):
        return 1

    def info(self):
        return SimpleNamespace(notes=[], captures=[], startup_check=None, kernel_warmup_s=None)

    def has_work(self):
        return not self.finished

    def cancel(self, rid):
        self.cancelled = True
        self.pieces.clear()

    def step(self):
        from fgchat.protocol.events import RequestFinished, RequestSummary, TokenEvent

        if self.pieces:
            text = self.pieces.pop(0)
            self.sent.append(text)
            i = len(self.sent) - 1
            return [TokenEvent(1, i, i, text, "eager", 1, 0, None, None, i == 0, 2 + i)]
        self.finished = True
        reason = "cancelled" if self.cancelled else "length"
        return [RequestFinished(RequestSummary(1, 2, len(self.sent), 1.0, 1.0, 2.0, reason, "".join(self.sent)))]


class TTY(io.StringIO):
    def isatty(self):
        return True


class ClosedPipe(io.StringIO):
    """A pipe whose reader went away after `limit` characters."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def write(self, s):
        if self.tell() + len(s) > self.limit:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)


@contextlib.contextmanager
def stdout_as(stream):
    """sys.stdout replaced for the body (not by monkeypatch: its undo would run after capsys's)."""
    old = sys.stdout
    sys.stdout = stream
    try:
        yield
    finally:
        if sys.stdout not in (stream, old):  # the devnull file silence_stdout opened
            sys.stdout.close()
        sys.stdout = old


@pytest.fixture
def fake_engine(monkeypatch):
    import fgchat.engine.core as core

    FakeEngine.instances.clear()
    monkeypatch.setattr(core, "Engine", FakeEngine)
    return FakeEngine.instances


@pytest.mark.parametrize("tty", [True, False])
def test_stream_strips_terminal_controls_only_on_a_tty(monkeypatch, capsys, fake_engine, tty):
    out = TTY() if tty else io.StringIO()
    with stdout_as(out):
        rc = main(GEN)
    err = capsys.readouterr().err
    assert rc == 0, err
    text = out.getvalue()
    if tty:
        assert text == CLEAN + "\n"
        assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F for c in text)
    else:
        assert text == "".join(PIECES) + "\n"  # piped output is untouched


def test_sanitizer_is_stateful_across_pieces():
    from fgchat.stdio import TerminalSanitizer, sanitize_terminal_text

    whole = "".join(PIECES)
    s = TerminalSanitizer()
    assert "".join(s.feed(c) for c in whole) == CLEAN == sanitize_terminal_text(whole)
    # an unterminated OSC ends at the newline instead of swallowing the rest
    assert sanitize_terminal_text("a\x1b]0;title\nrest") == "a\nrest"
    assert sanitize_terminal_text("plain text, ünïcödé 🙂") == "plain text, ünïcödé 🙂"


def test_broken_pipe_in_process_stops_quietly(monkeypatch, capsys, fake_engine):
    with stdout_as(ClosedPipe(limit=20)):
        rc = main(GEN)
    err = capsys.readouterr().err
    assert rc == 141
    assert "Traceback" not in err and "Broken" not in err
    engine = fake_engine[0]
    assert engine.cancelled and len(engine.sent) < len(PIECES)  # generation stopped early
    assert "cancelled" in err  # the latency summary still reaches stderr


def test_broken_pipe_subprocess(tiny):
    """stdout is a pipe nobody reads (`| head -c 0`): no traceback, no 'Exception ignored'."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    try:
        p = subprocess.run([sys.executable, "-m", "fgchat.cli", "generate", "--model", str(tiny), "--prompt",
                            "Hello", "--max-tokens", "40", "--device", "cpu"],
                           stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode in (0, 141), p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert "BrokenPipe" not in p.stderr
