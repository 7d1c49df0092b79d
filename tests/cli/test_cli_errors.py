"""Failures around the CLI's own input and output: signals during generate, stdout that cannot be
written, option messages, and the chat without a terminal. Each ends with its output kept and at
most one error line, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from child_signals import default_signals

from fgchat.cli import build_parser, main
from fgchat.generate import check_sampling_flags

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
FGCHAT = [sys.executable, "-m", "fgchat.cli"]


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("fgchat: error:")]


def generate_argv(model, *extra: str) -> list[str]:
    return [*FGCHAT, "generate", "--model", str(model), "--device", "cpu", "--prompt", "Hello", *extra]


# ---------------------------------------------------------------------------- signals during generate
# float32: no start-up check on any CPU (auto is bf16 on some, with a check between the engine's
# note and the first step), so the engine's "max context" note comes just before generation starts
STARTED_ARGS = ("--dtype", "float32")


def _wait_for_generation(p: subprocess.Popen) -> None:
    for line in p.stderr:
        if "max context" in line:
            return
    raise AssertionError(f"generate ended (exit {p.wait()}) before its engine's note")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signal_during_generate_keeps_the_json_and_summary(tiny_llama, sig):
    env = {**ENV, "FGCHAT_FAULT": "slow-steps"}  # 5 ms a step: 2000 tokens outlast the signal
    p = subprocess.Popen(generate_argv(tiny_llama, *STARTED_ARGS, "--json", "--max-tokens", "2000", "--raw"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=default_signals)
    try:
        _wait_for_generation(p)
        time.sleep(0.5)  # well inside the generation loop (2000 steps of >= 5 ms)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 128 + sig, err
    obj = json.loads(out)
    assert obj["finish_reason"] == "cancelled" and obj["output_tokens"] < 2000
    assert "[request 1]" in err and "cancelled" in err
    assert error_lines(err) == []


def test_ignored_hangup_stays_ignored(tiny_llama):
    """Under `nohup` (SIGHUP ignored on entry) a hangup does not stop generate."""
    env = {**ENV, "FGCHAT_FAULT": "slow-steps"}
    p = subprocess.Popen(generate_argv(tiny_llama, *STARTED_ARGS, "--json", "--max-tokens", "200", "--raw"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        _wait_for_generation(p)
        time.sleep(0.5)
        p.send_signal(signal.SIGHUP)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert json.loads(out)["finish_reason"] != "cancelled"



def test_interrupt_between_submit_and_first_step_still_reports(tiny_llama, monkeypatch, capsys):
    """An interrupt after the requests are submitted, before generation starts, still prints the
    JSON and a summary of every request (cancelled, no tokens)."""
    import fgchat.generate as generate

    def interrupted(*_a) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "startup_check_text", interrupted)
    argv = generate_argv(tiny_llama, "--json", "--n", "2", "--max-tokens", "8")[len(FGCHAT):]
    assert main(argv) == 128 + signal.SIGINT
    out, err = capsys.readouterr()
    obj = json.loads(out)
    assert [c["finish_reason"] for c in obj["completions"]] == ["cancelled", "cancelled"]
    assert "[request 1]" in err and "[request 2]" in err and "interrupted" in err

# ---------------------------------------------------------------------------- stdout that cannot be written
@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["stream", "json"])
def test_full_stdout_is_one_error_line_after_the_summary(tiny_llama, extra):
    with open("/dev/full", "w") as full:
        p = subprocess.run(generate_argv(tiny_llama, "--max-tokens", "8", *extra), stdout=full,
                           stderr=subprocess.PIPE, text=True, env=ENV, timeout=300)
    assert p.returncode == 2, p.stderr
    assert error_lines(p.stderr) == ["fgchat: error: cannot write to stdout: No space left on device"]
    assert p.stderr.rstrip().splitlines()[-1].startswith("fgchat: error:")
    assert "[request 1]" in p.stderr  # the latency summary still goes out


def _close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize("argv", [["--version"], ["generate", "--prompt", "hi", "--max-tokens", "2"]],
                         ids=["version", "generate"])
def test_closed_stdout_is_one_error_line(argv):
    p = subprocess.run([*FGCHAT, *argv], stderr=subprocess.PIPE, text=True, env=ENV, timeout=300,
                       preexec_fn=_close_stdout)
    assert p.returncode == 2, p.stderr
    assert error_lines(p.stderr) == ["fgchat: error: stdout is closed: nowhere to write the output"]
    assert "[request" not in p.stderr  # failed before any model loaded


def test_version_to_a_full_disk_is_one_error_line():
    with open("/dev/full", "w") as full:
        p = subprocess.run([*FGCHAT, "--version"], stdout=full, stderr=subprocess.PIPE, text=True,
                           env=ENV, timeout=60)
    assert p.returncode == 2
    assert p.stderr == "fgchat: error: cannot write to stdout: No space left on device\n"


# ---------------------------------------------------------------------------- option messages
@pytest.mark.parametrize("command", [[], ["generate", "--prompt", "hi"], ["serve"]], ids=["tui", "generate", "serve"])
def test_unknown_mode_lists_plain_names(capsys, command):
    with pytest.raises(SystemExit) as exc:  # argparse's error
        main([*command, "--mode", "turbo"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err == ("fgchat: error: argument --mode: invalid choice: 'turbo' "
                   "(choose from 'eager', 'piecewise', 'full', 'mega') (see --help)\n")


def test_seed_range_error_names_what_the_user_typed(capsys):
    seed = 2**63 - 2
    assert main(["generate", "--prompt", "hi", "--n", "8", "--seed", str(seed)]) == 2
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert f"--seed {seed} with --n 8" in line and "seed..seed+n-1" in line
    assert f"use --seed <= {2**63 - 8}" in line
    assert str(seed + 7) not in line  # a number the user never typed
    # the largest seed that fits passes the check
    check_sampling_flags(build_parser().parse_args(["generate", "--prompt", "hi", "--n", "8",
                                                    "--seed", str(2**63 - 8)]))


# ---------------------------------------------------------------------------- the chat without a terminal
@pytest.mark.parametrize("argv", [[], ["--endpoint", "http://127.0.0.1:9/v1"]], ids=["engine", "endpoint"])
def test_chat_without_a_terminal_is_one_error_line(argv):
    p = subprocess.run([*FGCHAT, *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert p.returncode == 2
    assert p.stdout == ""  # no escape codes
    assert p.stderr == ("fgchat: error: the chat needs a terminal on stdin and stdout; use `fgchat generate` "
                        "or `fgchat serve` for scripts\n")
