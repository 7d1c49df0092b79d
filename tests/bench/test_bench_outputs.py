"""`fgchat bench` keeps what it measured: the result files survive a failing stdout, a failing
file, Ctrl-C between batch sizes; a run that measured nothing writes nothing."""

from __future__ import annotations

import csv
import errno
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from fgchat.cli import main

TINY = ["bench", "--preset", "tiny", "--random-weights", "--prompt-len", "16", "--output-len", "4",
        "--repeats", "1", "--warmup", "0", "--no-progress"]


@pytest.fixture(autouse=True)
def _quiet_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bench sets it; restored after each test


def outputs(tmp_path: Path) -> tuple[list[str], dict[str, Path]]:
    paths = {"json": tmp_path / "r.json", "csv": tmp_path / "r.csv", "chart": tmp_path / "r.svg"}
    return [a for k, p in paths.items() for a in (f"--{k}", str(p))], paths


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [ln for ln in err.splitlines() if ln.strip()]


class FailingStdout(io.StringIO):
    def __init__(self, exc: OSError) -> None:
        super().__init__()
        self.exc = exc

    def write(self, text: str) -> int:
        raise self.exc


@pytest.mark.parametrize("exc,rc", [(OSError(errno.ENOSPC, "No space left on device"), 2),
                                    (BrokenPipeError(errno.EPIPE, "Broken pipe"), 141)])
def test_files_survive_a_failing_stdout(tmp_path, capsys, monkeypatch, exc, rc):
    args, paths = outputs(tmp_path)
    monkeypatch.setattr(sys, "stdout", FailingStdout(exc))
    assert main([*TINY, "--batch-sizes", "1", *args]) == rc
    lines = error_lines(capsys.readouterr().err)
    if rc == 141:  # a closed pipe ends the output quietly
        assert lines == []
    else:
        assert lines == ["fgchat: error: cannot write the report to stdout: No space left on device"]
    assert [r["batch_size"] for r in json.loads(paths["json"].read_text())["runs"]] == [1]
    assert paths["csv"].read_text().startswith("runner,batch_size")
    assert "<svg" in paths["chart"].read_text()


def test_one_failing_file_does_not_drop_the_others(tmp_path, capsys, monkeypatch):
    from fgchat.bench import report

    def full_disk(result, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_json", full_disk)
    args, paths = outputs(tmp_path)
    assert main([*TINY, "--batch-sizes", "1", *args]) == 2
    out, err = capsys.readouterr()
    assert error_lines(err) == [f"fgchat: error: cannot write --json {paths['json']}: No space left on device"]
    assert "summary" in out and f"chart written to {paths['chart']}" in out
    assert not paths["json"].exists()
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [(r["batch_size"], r["interrupted"]) for r in rows] == [("1", "false")]
    assert "interrupted" not in paths["chart"].read_text()


def test_ctrl_c_among_the_peers_keeps_their_finished_rows(tmp_path, capsys, monkeypatch):
    from fgchat.bench import peers

    measured = peers._measure

    def interrupted_at_batch_2(model, spec, b, *rest):
        if b > 1:
            raise KeyboardInterrupt
        return measured(model, spec, b, *rest)

    monkeypatch.setattr(peers, "_measure", interrupted_at_batch_2)
    args, paths = outputs(tmp_path)
    assert main([*TINY, "--modes", "eager", "--batch-sizes", "1,2", "--peers", "hf-eager", *args]) == 130
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["interrupted"] is True
    assert [(r["runner"], r["batch_size"]) for r in data["runs"]] == [
        ("fgchat-eager", 1), ("fgchat-eager", 2), ("hf-eager", 1)]


def test_ctrl_c_keeps_the_finished_batch_sizes(tmp_path, capsys, monkeypatch):
    from fgchat.bench import runner

    measured = runner.measure_engine

    def interrupted_after_first(engine, mode, batch, spec, method="off", prompt_set=None):
        if batch > 1:
            raise KeyboardInterrupt
        return measured(engine, mode, batch, spec, method, prompt_set)

    monkeypatch.setattr(runner, "measure_engine", interrupted_after_first)
    args, paths = outputs(tmp_path)
    assert main([*TINY, "--batch-sizes", "1,2", *args]) == 130
    out, err = capsys.readouterr()
    assert error_lines(err) == ["fgchat: interrupted"]
    assert "interrupted (Ctrl-C)" in out and "summary" in out
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["interrupted"] is True
    assert [r["batch_size"] for r in data["runs"]] == [1]
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [(r["batch_size"], r["interrupted"]) for r in rows] == [("1", "true")]
    assert "interrupted (Ctrl-C)" in paths["chart"].read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="full mode runs on CUDA")
def test_nothing_measured_is_an_error_that_writes_nothing(tmp_path, capsys):
    args, paths = outputs(tmp_path)
    paths["csv"].write_text("earlier results\n")
    assert main([*TINY, "--batch-sizes", "1", "--modes", "full", *args]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1
    assert lines[0].startswith("fgchat: error: no requested mode could run here: fgchat-full: CUDA graphs")
    assert paths["csv"].read_text() == "earlier results\n"
    assert not paths["json"].exists() and not paths["chart"].exists()
