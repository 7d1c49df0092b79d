"""scripts/llama_cpp.sh's quantize and bench commands on CPU, with stand-ins for the llama.cpp tools
(the real ones are built on the GPU machine): bad arguments are one message and status 2;
`quantize` quantizes the preset's random bf16 GGUF once per type and keeps the files; `bench` with
a quantization type in DTYPES measures that file, and its rows name the type."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "llama_cpp.sh"

# llama-quantize SRC DST TYPE: records its call, writes DST (the script's DST.part, renamed when done)
QUANTIZE_STUB = """#!{python}
import json, os, sys
src, dst, kind = sys.argv[1:4]
with open(os.environ["STUB_CALLS"], "a") as f:
    f.write(json.dumps(["llama-quantize", src, os.path.basename(dst), kind]) + "\\n")
open(dst, "wb").write(b"GGUF" + kind.encode())
"""
# llama-batched-bench: one JSON line per -npl entry, as --output-format jsonl writes them
BENCH_STUB = """#!{python}
import json, os, sys
args = sys.argv[1:]
model = args[args.index("-m") + 1]
with open(os.environ["STUB_CALLS"], "a") as f:
    f.write(json.dumps(["llama-batched-bench", os.path.basename(model), open(model, "rb").read(4).decode()]) + "\\n")
pp, tg = int(args[args.index("-npp") + 1]), int(args[args.index("-ntg") + 1])
for pl in args[args.index("-npl") + 1].split(","):
    print(json.dumps({{"n_kv_max": 8192, "pl": int(pl), "pp": pp, "tg": tg, "t_pp": 0.05, "t_tg": 0.25,
                      "speed_tg": int(pl) * tg / 0.25, "flash_attn": 1, "n_gpu_layers": 99}}))
"""


def _run(work: Path, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "LLAMACPP_WORK": str(work), "OUT": str(work / "out"), "PYTHON": sys.executable,
            "STUB_CALLS": str(work / "calls.jsonl"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=300,
                          cwd=cwd)


@pytest.fixture
def work(tmp_path) -> Path:
    bin_dir = tmp_path / "build-cpu" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("llama-quantize", QUANTIZE_STUB), ("llama-batched-bench", BENCH_STUB)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "src" / "llama.cpp").mkdir(parents=True)
    (tmp_path / "src" / "llama.cpp" / "LLAMACPP_COMMIT").write_text("0123456789abcdef\n")
    return tmp_path


def _calls(work: Path) -> list[list[str]]:
    path = work / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("args,env,needle", [
    (["quantize"], {}, "quantize: name one or more presets"),
    (["quantize", "model.gguf"], {}, "quantize: name presets, not files (model.gguf)"),
    (["quantize", "tiny"], {"QUANTS": "Q8_0 IQ2_XS"}, "quantize: unknown type 'IQ2_XS'"),
    (["bench", "tiny"], {"DTYPES": "bf16 Q3_K"}, "bench: unknown dtype 'Q3_K'"),
    (["build", "rocm"], {}, "build: cpu or cuda, not 'rocm'"),
])
def test_bad_arguments(work, args, env, needle):
    p = _run(work, *args, **env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip().splitlines()[0]] and needle in p.stderr
    assert not _calls(work)


def test_quantize_without_a_build(tmp_path):
    p = _run(tmp_path, "quantize", "tiny")
    assert p.returncode == 1 and "llama-quantize: run 'bash scripts/llama_cpp.sh build cpu' first" in p.stderr


def test_quantize_then_bench_the_quantized_file(work):
    pytest.importorskip("gguf")
    p = _run(work, "quantize", "tiny")
    assert p.returncode == 0, p.stderr
    bf16 = work / "gguf" / "tiny-bf16.gguf"
    assert bf16.read_bytes()[:4] == b"GGUF"  # tools/random_gguf.py's file
    assert _calls(work) == [["llama-quantize", str(bf16), "tiny-Q8_0.gguf.part", "Q8_0"],
                            ["llama-quantize", str(bf16), "tiny-Q4_K_M.gguf.part", "Q4_K_M"]]
    assert p.stdout.split() == [str(work / "gguf" / f"tiny-{t}.gguf") for t in ("Q8_0", "Q4_K_M")]
    assert _run(work, "quantize", "tiny").returncode == 0
    assert len(_calls(work)) == 2  # kept: not quantized again

    p = _run(work, "bench", "tiny", DTYPES="Q4_K_M Q6_K", BATCHES="1,8", REPEATS="2")
    assert p.returncode == 0, p.stderr
    # Q6_K was not made yet: bench quantizes it first, then measures both files as they are
    assert _calls(work)[2:] == [["llama-batched-bench", "tiny-Q4_K_M.gguf", "GGUF"],
                                ["llama-quantize", str(bf16), "tiny-Q6_K.gguf.part", "Q6_K"],
                                ["llama-batched-bench", "tiny-Q6_K.gguf", "GGUF"]]
    rows = json.loads((work / "out" / "llamacpp.json").read_text())
    assert [(r["dtype"], r["batch_size"]) for r in rows] == [("Q4_K_M", 1), ("Q4_K_M", 8), ("Q6_K", 1), ("Q6_K", 8)]
    assert all(r["tpot_ms"] == 1000 * 0.25 / 128 and r["backend"] == "cpu" for r in rows)


def test_bench_a_config_path(work):
    """A PRESET given as a relative config.json path (from the caller's folder): its GGUF is named by
    the folder, written in its own architecture, named so in the rows, and made again once the
    config changes."""
    gguf = pytest.importorskip("gguf")
    from fgchat.presets import preset_path

    cfg = json.loads(preset_path("qwen3-0.6b").read_text()) | {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}
    config = work / "models" / "qwen3-mini" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(cfg))
    p = _run(work, "bench", "models/qwen3-mini/config.json", cwd=work, DTYPES="bf16", BATCHES="1", REPEATS="1")
    assert p.returncode == 0, p.stderr
    made = work / "gguf" / "qwen3-mini-bf16.gguf"
    r = gguf.GGUFReader(str(made))
    assert r.fields["general.architecture"].contents() == "qwen3"
    assert r.fields["qwen3.embedding_length"].contents() == 64
    assert _calls(work) == [["llama-batched-bench", "qwen3-mini-bf16.gguf", "GGUF"]]
    rows = json.loads((work / "out" / "llamacpp.json").read_text())
    assert [(r["preset"], r["dtype"], r["batch_size"]) for r in rows] == [("qwen3-mini", "bf16", 1)]

    config.write_text(json.dumps(cfg | {"hidden_size": 96}))
    later = made.stat().st_mtime + 10
    os.utime(config, (later, later))
    assert _run(work, "bench", str(config), DTYPES="bf16", BATCHES="1", REPEATS="1").returncode == 0
    assert gguf.GGUFReader(str(made)).fields["qwen3.embedding_length"].contents() == 96
