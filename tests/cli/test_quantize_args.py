"""--quantize and --dequantize on the chat, `generate`, `bench` and `serve`: bad combinations are
one line before anything loads; good ones reach the engine's config (bench: one engine per
--quantize value, rows labelled); `generate --json` names the weights."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import file_weight_bytes
from test_cli_bad_input import assert_one_line_error, run_main, tiny  # noqa: F401

from fgchat.engine.devices import pick_dtype

GGUF = "/some/where/model.Q4_K_M.gguf"


@pytest.fixture
def gguf_file(tmp_path) -> str:
    """A path the chat accepts as a GGUF file (it checks that the file exists before starting)."""
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def captured(monkeypatch):
    """The EngineConfig (chat, generate, serve) or BenchSpec (bench) each entry would run with."""
    from fgchat import generate, tui
    from fgchat.bench import runner
    from fgchat.protocol.config import EngineConfig
    from fgchat.serve import run

    seen = {}

    def keep(entry):
        def fake(args, config):
            seen[entry] = config
            return 0

        return fake

    monkeypatch.setattr(generate, "run_generate", keep("generate"))
    monkeypatch.setattr(run, "run_serve", keep("serve"))

    def fake_tui(**options):
        seen["chat"] = EngineConfig(**{k: v for k, v in options.items() if k in EngineConfig.__dataclass_fields__})
        return 0

    monkeypatch.setattr(tui, "run_tui", fake_tui)
    monkeypatch.setattr("fgchat.cli._check_terminal", lambda: None)

    def fake_run_all(spec):
        from fgchat.protocol.errors import FgchatError

        seen["bench"] = spec
        raise FgchatError("run_all reached")

    monkeypatch.setattr(runner, "run_all", fake_run_all)
    return seen


ENTRIES = {"chat": [], "generate": ["generate", "--prompt", "hi"], "serve": ["serve"]}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_quantize_reaches_the_engine_config(capsys, tiny, captured, gguf_file, entry):  # noqa: F811
    assert run_main(capsys, [*ENTRIES[entry], "--model", str(tiny), "--quantize", "int4"])[0] == 0
    assert (captured[entry].quantize, captured[entry].dequantize) == ("int4", False)
    assert run_main(capsys, [*ENTRIES[entry], "--model", gguf_file, "--dequantize"])[0] == 0
    assert (captured[entry].quantize, captured[entry].dequantize) == ("none", True)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_gguf_file_is_not_quantized_again(capsys, captured, entry):
    for model in ([], ["--model", GGUF]):
        rc, _, err = run_main(capsys, [*ENTRIES[entry], *model, "--quantize", "fp8"])
        line = assert_one_line_error(rc, err, "--quantize fp8: ")
        assert "is already quantized; --dequantize runs it in bf16" in line
        assert ("embedded model" in line) == (not model)
    assert not captured


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_dequantize_needs_a_gguf_file(capsys, tiny, captured, entry):  # noqa: F811
    rc, _, err = run_main(capsys, [*ENTRIES[entry], "--model", str(tiny), "--dequantize"])
    assert_one_line_error(rc, err, f"--dequantize applies to GGUF files; {tiny} is not one")
    assert not captured


@pytest.mark.parametrize("argv", [["--quantize", "int8"], ["generate", "--prompt", "x", "--quantize", "q4"],
                                  ["bench", "--quantize", "none,int3"]])
def test_unknown_format_is_one_line(capsys, argv):
    rc, _, err = run_main(capsys, argv)
    assert_one_line_error(rc, err, "invalid choice")


def test_endpoint_takes_neither(capsys, captured):
    for extra, option in ((["--quantize", "int4"], "--quantize"), (["--dequantize"], "--dequantize")):
        rc, _, err = run_main(capsys, ["--endpoint", "http://127.0.0.1:9/v1", *extra])
        assert_one_line_error(rc, err, f"{option} configures a local engine")
        rc, _, err = run_main(capsys, ["bench", "--endpoint", "http://127.0.0.1:9/v1", *extra])
        assert_one_line_error(rc, err, f"{option} configures a local engine")
    assert not captured


BENCH = ["bench", "--batch-sizes", "1", "--prompt-len", "8", "--output-len", "2"]


def test_bench_takes_a_list(capsys, tiny, captured):  # noqa: F811
    rc, _, err = run_main(capsys, [*BENCH, "--preset", "tiny", "--random-weights", "--quantize", "int4,none,int4,fp8"])
    assert_one_line_error(rc, err, "run_all reached")
    assert captured["bench"].quantize == ["int4", "none", "fp8"]  # each value once, in order given
    rc, _, err = run_main(capsys, [*BENCH, "--model", GGUF, "--dequantize"])
    assert_one_line_error(rc, err, "run_all reached")
    assert (captured["bench"].quantize, captured["bench"].dequantize) == (["none"], True)
    rc, _, err = run_main(capsys, [*BENCH, "--quantize", "none,int4"])  # the embedded GGUF
    assert_one_line_error(rc, err, "--quantize int4: the embedded model's GGUF file is already quantized")
    rc, _, err = run_main(capsys, [*BENCH, "--preset", "tiny", "--random-weights", "--dequantize"])
    assert_one_line_error(rc, err, "--dequantize applies to GGUF files; --random-weights makes unquantized")


def test_generate_json_names_the_weights(capsys, tiny):  # noqa: F811
    rc, out, err = run_main(capsys, ["generate", "--model", str(tiny), "--device", "cpu", "--prompt", "hi",
                                     "--max-tokens", "2", "--json"])
    assert rc == 0, err
    head = json.loads(out)
    dtype = pick_dtype("auto", torch.device("cpu"))  # the command line's default
    total, step = file_weight_bytes(tiny, dtype)
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    assert (head["weights"], head["weight_bytes"], head["step_bytes"]) == (name, total, step)
    assert f"fgchat: weights {name}, {total / 1e6:.1f} MB on cpu" in err.splitlines()


def test_bench_rows_per_weight_set(capsys, tmp_path):
    out_json = tmp_path / "r.json"
    rc, out, err = run_main(capsys, ["bench", "--preset", "tiny", "--random-weights", "--prompt-len", "8",
                                     "--output-len", "3", "--repeats", "1", "--warmup", "0", "--no-progress",
                                     "--modes", "eager", "--batch-sizes", "1,2", "--quantize", "none,int4",
                                     "--json", str(out_json)])
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    assert [(r["runner"], r["batch_size"]) for r in data["runs"]] == [
        ("fgchat-eager", 1), ("fgchat-eager", 2), ("fgchat-eager-int4", 1), ("fgchat-eager-int4", 2)]
    sets = data["meta"]["weight_sets"]
    assert [s["quantize"] for s in sets] == ["none", "int4"] and [s["label"] for s in sets] == ["", "int4"]
    for run in data["runs"]:
        ws = sets[run["runner"].endswith("-int4")]
        assert (run["weights"], run["weight_bytes"], run["step_bytes"]) == (
            ws["weights"], ws["weight_bytes"], ws["step_bytes"])
        assert run["bandwidth_share"] is None  # CPU: no GPU time, no known peak
    # each set's x-eager compares with its own eager rows
    assert all(r["speedup_vs_fgchat-eager"] == 1.0 for r in data["summary"])
    assert "weights " in out and "peak memory bandwidth: unknown" in out
