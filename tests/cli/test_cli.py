"""The headless CLI as a user runs it: subprocesses, stdout/stderr, exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def fgchat(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fgchat.cli", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=timeout)


def assert_one_line_error(p: subprocess.CompletedProcess, needle: str) -> None:
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert needle in lines[0], lines[0]


def test_generate_json_matches_engine(tiny_llama):
    p = fgchat("generate", "--model", str(tiny_llama), "--prompt", "Hello there", "--max-tokens", "12",
               "--json", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert set(obj) >= {"text", "token_ids", "ttft_ms", "tpot_ms", "itl_ms", "model"}
    assert 1 <= len(obj["token_ids"]) <= 12
    assert len(obj["itl_ms"]) == len(obj["token_ids"]) - 1
    assert "ttft" in p.stderr and "tpot" in p.stderr


def test_generate_n_batches(tiny_llama):
    p = fgchat("generate", "--model", str(tiny_llama), "--prompt", "Hi", "--max-tokens", "6", "--n", "3",
               "--temperature", "1.0", "--seed", "5", "--json")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert len(obj["completions"]) == 3
    assert "batch 3" in p.stderr


def test_generate_streams_text(tiny_llama):
    p = fgchat("generate", "--model", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "8", "--raw")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("[request") == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/nonexistent/model"], "not found"),
        (["--model", "nobody-xyz/does-not-exist-42"], "nobody-xyz/does-not-exist-42"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-k", "-3"], "top-k"),
        (["--n", "9"], "--n"),
        (["--n", "0"], "--n"),
        (["--max-tokens", "0"], "max tokens"),
    ],
)
def test_bad_input_is_one_line(tiny_llama, args, needle):
    base = ["generate", "--prompt", "hi"]
    if "--model" not in args:
        base += ["--model", str(tiny_llama)]
    assert_one_line_error(fgchat(*base, *args), needle)


def test_prompt_longer_than_context(tiny_llama):
    p = fgchat("generate", "--model", str(tiny_llama), "--prompt", "word " * 400, "--max-context", "128")
    assert_one_line_error(p, "context holds 128")


def test_unsupported_architecture(tmp_path, tiny_llama):
    import shutil

    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(fgchat("generate", "--model", str(d), "--prompt", "hi"), "LlamaForCausalLM")


def test_truncated_weights(tmp_path, tiny_llama):
    import shutil

    d = tmp_path / "cut"
    shutil.copytree(tiny_llama, d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    assert_one_line_error(fgchat("generate", "--model", str(d), "--prompt", "hi"), "model.safetensors")


def test_unknown_subcommand_option_is_one_line():
    assert_one_line_error(fgchat("generate"), "--prompt")


def test_bench_smoke_json(tmp_path):
    out = tmp_path / "bench.json"
    csv_out = tmp_path / "bench.csv"
    p = fgchat("bench", "--preset", "tiny", "--random-weights", "--batch-sizes", "1,2", "--prompt-len", "16",
               "--output-len", "6", "--repeats", "1", "--warmup", "0", "--json", str(out), "--csv",
               str(csv_out), "--no-progress")
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    runs = {(r["runner"], r["batch_size"]): r for r in data["runs"]}
    assert set(runs) == {("fgchat-eager", 1), ("fgchat-eager", 2)}
    for r in runs.values():
        assert r["tpot_ms"]["mean"] > 0 and r["ttft_ms"]["mean"] > 0
        assert r["requests"] == r["batch_size"]
        # eager launches every kernel from the host: its launch time is most of the step
        assert 0 < r["launch_ms"]["mean"] <= r["itl_ms"]["mean"]
    skipped = {s["runner"] for s in data["skipped"]}
    assert skipped == {"fgchat-piecewise", "fgchat-full"}  # CPU: graphs skipped with a reason
    assert "TPOT" in p.stdout and "summary" in p.stdout
    header = csv_out.read_text().splitlines()[0].split(",")
    assert header[:2] == ["runner", "batch_size"] and "launch_ms_mean" in header
    meta = data["meta"]
    assert meta["pdl"] is False and meta["kernel_warmup_s"] is None  # CPU: no PDL, no graphs
    assert isinstance(meta["tuning_changed"], dict)
    assert meta["tuning_changed"]["prefix_reuse"] is False  # rounds repeat prompts: each prefilled afresh
    assert meta["gc_frozen_objects"] > 10000  # the heap was frozen before timing (engine.heap)
    assert isinstance(meta["host_cpu"], str) and meta["host_cpu"]
    assert meta["sampling"] is None


def test_bench_samples_when_asked(tmp_path):
    """--temperature / --top-k run fgchat's sampled steps (the meta says so; greedy runs say None)."""
    out = tmp_path / "bench.json"
    p = fgchat("bench", "--preset", "tiny", "--random-weights", "--batch-sizes", "2", "--prompt-len", "16",
               "--output-len", "6", "--repeats", "1", "--warmup", "0", "--json", str(out), "--no-progress",
               "--temperature", "0.7", "--top-k", "20")
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["meta"]["sampling"] == {"temperature": 0.7, "top_k": 20}
    assert [r["batch_size"] for r in data["runs"]] == [2] and data["runs"][0]["tpot_ms"]["mean"] > 0


def test_bench_report_separates_prefill_graphs():
    import io

    from fgchat.bench.report import print_report

    run = {"runner": "fgchat-full", "mode": "full", "batch_size": 1, "requests": 1, "output_tokens_per_s": 900.0,
           "host_overhead_ms": 0.02, "decode_modes": ["full"]}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "gpu_step_ms", "launch_ms"):
        run[key] = {"mean": 1.0, "median": 1.0, "p90": 1.0, "p99": 1.0}
    run["launch_ms"]["mean"] = 0.375
    caps = [{"mode": "full", "batch_size": 1, "seconds": 0.02, "pool_mib": 2.0, "kind": "decode"},
            {"mode": "full", "batch_size": 32, "seconds": 0.1, "pool_mib": 8.0, "kind": "prefill"},
            {"mode": "full", "batch_size": 512, "seconds": 0.3, "pool_mib": 30.0, "kind": "prefill"}]
    meta = {"model": "m", "device": "d", "dtype": "bfloat16", "attention": "triton", "prompt_len": 512,
            "output_len": 128, "commit": "abc", "kernel_warmup_s": 1.25}
    out = io.StringIO()
    print_report({"meta": meta, "runs": [run], "captures": caps, "skipped": []}, out)
    text = out.getvalue()
    assert "graph capture total: 0.42 s, pools 40.0 MiB" in text
    assert re.search(r"Host launch per step \(ms\): +0\.375\n", text)
    assert "host-bound" not in text  # 0.375 ms to launch a 1.0 ms step
    run["launch_ms"]["mean"] = 0.8
    out = io.StringIO()
    print_report({"meta": meta, "runs": [run], "captures": caps, "skipped": []}, out)
    assert ("host-bound: fgchat-full batch 1 takes 0.800 ms to launch a step the GPU runs in 1.000 ms"
            in out.getvalue())
    assert "prefill graphs (2 token buckets up to 512): 0.40 s, 38.0 MiB" in text
    assert "kernel warm-up before capture (Triton JIT on a cold cache): 1.25 s" in text
    block = text.split("fgchat-full | batch 1")[1]
    assert "Graph capture (s):                           0.020" in block  # the decode graph only


def test_bench_unknown_preset():
    p = fgchat("bench", "--preset", "gpt5", "--random-weights")
    assert_one_line_error(p, "llama-3.2-1b")


@pytest.mark.parametrize("args,needle", [(["--mode", "turbo"], "--mode: invalid choice: 'turbo'"),
                                         (["--attention", "warp-drive"], "--attention: invalid choice")])
def test_unknown_mode_and_backend_are_rejected(tiny_llama, args, needle):
    p = fgchat("generate", "--model", str(tiny_llama), "--prompt", "hi", "--max-tokens", "3", *args)
    assert p.returncode == 2
    assert_one_line_error(p, needle)


def test_graph_modes_on_cpu_fall_back_to_eager(tiny_llama):
    p = fgchat("generate", "--model", str(tiny_llama), "--prompt", "hi", "--max-tokens", "3",
               "--mode", "piecewise", "--json")
    assert p.returncode == 0, p.stderr
    assert "piecewise unavailable" in p.stderr
    assert json.loads(p.stdout)["mode"] == "eager"


def test_bench_peer_without_compile_is_marked(monkeypatch):
    """--peers hf where torch.compile is unusable: the compile rows are marked, the run goes on."""
    import torch

    from fgchat.bench.peers import run_hf_peers
    from fgchat.bench.runner import BenchSpec

    def no_compile(*a, **k):
        raise RuntimeError("torch.compile is not supported here")

    monkeypatch.setattr(torch, "compile", no_compile)
    spec = BenchSpec(preset="tiny", batch_sizes=[1], prompt_len=8, output_len=3, warmup=0, repeats=1,
                     peers=["hf"], device="cpu")
    runs, skipped = run_hf_peers(spec, None, lambda label: None)
    assert [r["runner"] for r in runs] == ["hf-eager"]
    assert runs[0]["tpot_ms"]["mean"] > 0
    assert skipped and skipped[0]["runner"] == "hf-compile" and "not supported" in skipped[0]["reason"]


def test_bench_peer_timeout_marks_the_rest(monkeypatch):
    """A peer past --peer-timeout: batch sizes done stay, the rest are marked with the reason, no crash."""
    import time

    from fgchat.bench import peers
    from fgchat.bench.runner import BenchSpec

    real = peers._generate

    def slow(*a, **k):
        time.sleep(1.0)
        return real(*a, **k)

    monkeypatch.setattr(peers, "_generate", slow)
    spec = BenchSpec(preset="tiny", batch_sizes=[1, 2, 4], prompt_len=8, output_len=3, warmup=0, repeats=1,
                     peers=["hf-eager"], device="cpu")
    spec.peer_timeout = 1.5  # two calls per batch size (warm-up, repeat): batch 1 ends past the budget
    runs, skipped = peers.run_hf_peers(spec, None, lambda label: None)
    assert [(r["runner"], r["batch_size"]) for r in runs] == [("hf-eager", 1)]
    assert len(skipped) == 1 and skipped[0]["runner"] == "hf-eager"
    assert "--peer-timeout" in skipped[0]["reason"] and "batch size(s) 2, 4" in skipped[0]["reason"]


def test_bench_peer_timing_is_per_token(monkeypatch):
    """TTFT = first streamed token, TPOT = (last - first) / (n - 1), warm-up calls not counted."""
    from fgchat.bench import peers
    from fgchat.bench.runner import BenchSpec

    calls = []

    def fake(model, ids, n, extra):
        calls.append(n)
        return [5.0 + 2.0 * i for i in range(n)], 5.0 + 2.0 * (n - 1) + 1.0

    monkeypatch.setattr(peers, "_generate", fake)
    spec = BenchSpec(preset="tiny", batch_sizes=[2], prompt_len=8, output_len=4, warmup=2, repeats=3,
                     peers=["hf-eager"], device="cpu")
    runs, skipped = peers.run_hf_peers(spec, None, lambda label: None)
    assert not skipped and len(calls) == 2 + 3
    r = runs[0]
    assert r["ttft_ms"]["mean"] == 5.0 and r["tpot_ms"]["mean"] == 2.0 and r["itl_ms"]["p99"] == 2.0
    assert r["requests"] == 6 and abs(r["output_tokens_per_s"] - 2 * 4 / 0.012) < 1e-6


def test_bench_peer_compile_once_per_batch_size():
    """hf-compile on CPU: the decode step compiles in warm-up, once per batch size; timed repeats compile nothing."""
    from fgchat.bench.peers import run_hf_peers
    from fgchat.bench.runner import BenchSpec

    spec = BenchSpec(preset="tiny", batch_sizes=[1, 2], prompt_len=8, output_len=4, warmup=0, repeats=2,
                     peers=["hf-compile"], device="cpu")
    runs, skipped = run_hf_peers(spec, None, lambda label: None)
    assert not skipped, skipped
    assert [r["batch_size"] for r in runs] == [1, 2]
    for r in runs:
        assert r["graphs_compiled_warmup"] >= 1 and r["graphs_compiled_timed"] == 0
        assert r["tpot_ms"]["mean"] > 0 and r["ttft_ms"]["mean"] > 0


def test_bench_bad_peer_timeout_is_one_line():
    p = fgchat("bench", "--preset", "tiny", "--random-weights", "--peers", "hf", "--peer-timeout", "0")
    assert_one_line_error(p, "--peer-timeout")
