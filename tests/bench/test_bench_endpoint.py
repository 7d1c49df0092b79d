"""`fgchat bench --endpoint`: the bench grid against a real `fgchat serve` on localhost."""

from __future__ import annotations

import json

import pytest

from fgchat.cli import main
from fgchat.serve.launch import start_server


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(["--model", str(tiny_llama), "--device", "cpu", "--max-context", "512"])
    yield srv
    srv.stop()


def test_bench_endpoint_measures_streams_and_skips_unavailable_modes(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--endpoint", server.base, "--modes", "eager,full", "--batch-sizes", "1,3",
               "--prompt-len", "12", "--output-len", "6", "--warmup", "0", "--repeats", "2", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "endpoint-eager | batch 3" in text
    result = json.loads(out.read_text())
    runs = {(r["runner"], r["batch_size"]): r for r in result["runs"]}
    assert set(runs) == {("endpoint-eager", 1), ("endpoint-eager", 3)}
    assert runs[("endpoint-eager", 3)]["requests"] == 6  # 3 concurrent streams x 2 repeats
    for r in runs.values():
        assert r["ttft_ms"]["mean"] > 0 and r["itl_ms"]["mean"] > 0 and r["tpot_ms"]["mean"] > 0
        assert r["gpu_step_ms"]["mean"] is None  # CPU server: no GPU timing
        assert r["decode_modes"] == ["eager"]
    assert [s["runner"] for s in result["skipped"]] == ["endpoint-full"]
    assert "CUDA" in result["skipped"][0]["reason"]
    assert result["meta"]["fgchat_server"] is True and "client" in result["meta"]["timing"]


def test_ctrl_c_keeps_the_endpoint_runs_that_finished(server, tmp_path, capsys, monkeypatch):
    from fgchat.bench import endpoint

    measured = endpoint.measure

    def interrupted_after_first(session, runner, mode, batch, args):
        if batch > 1:
            raise KeyboardInterrupt
        return measured(session, runner, mode, batch, args)

    monkeypatch.setattr(endpoint, "measure", interrupted_after_first)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--endpoint", server.base, "--modes", "eager", "--batch-sizes", "1,2",
               "--prompt-len", "12", "--output-len", "6", "--warmup", "0", "--repeats", "1", "--no-progress",
               "--json", str(out)])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["meta"]["interrupted"] is True
    assert [(r["runner"], r["batch_size"]) for r in result["runs"]] == [("endpoint-eager", 1)]


@pytest.mark.parametrize("extra, needle", [
    (["--preset", "x"], "preset"),
    (["--device", "cpu"], "--device"),
    (["--peers", "hf"], "--peers"),
])
def test_bench_endpoint_rejects_local_engine_options(extra, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        rc = main(["bench", "--endpoint", "http://127.0.0.1:9/v1", *extra])
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_bench_endpoint_unreachable_is_one_line(capsys):
    rc = main(["bench", "--endpoint", "http://127.0.0.1:9/v1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot use" in err and "Traceback" not in err


def test_a_batch_size_whose_streams_are_cut_is_reported_and_the_rest_measured(tmp_path, capsys):
    """A server that cuts a stream when another request arrives (llama-cpp-python's default):
    batch 2 fails, batches 1 before and after it are measured and kept."""
    from fake_openai import FakeServer

    out = tmp_path / "bench.json"
    with FakeServer("cut_on_arrival", tokens=8) as fake:
        rc = main(["bench", "--endpoint", fake.base, "--batch-sizes", "1,2,1", "--prompt-len", "4",
                   "--output-len", "8", "--warmup", "0", "--repeats", "1", "--no-progress", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(out.read_text())
    assert [(r["runner"], r["batch_size"]) for r in result["runs"]] == [("endpoint", 1), ("endpoint", 1)]
    assert all(r["requests"] == 1 and r["itl_ms"]["mean"] > 0 for r in result["runs"])
    assert result["runs"][0]["decode_modes"] == ["remote"]  # the server does not say how it runs
    (skip,) = result["skipped"]
    assert skip["runner"] == "endpoint" and skip["reason"].startswith("batch 2: ")
    assert "stream ended before the reply finished" in skip["reason"]
    assert "endpoint batch 2 failed" in captured.err and "Traceback" not in captured.err
    assert "skipped endpoint: batch 2: " in captured.out
