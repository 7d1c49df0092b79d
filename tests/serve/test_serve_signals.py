"""`fgchat serve` stopped by SIGTERM or Ctrl-C (SIGINT) before its model has loaded: one line on
stderr, exit status 0 (as after start-up), no traceback or multiprocessing warning, and no engine
process left behind.

The load is held open from outside the server: a `sitecustomize` on PYTHONPATH makes the spawned
engine process block at its import of `fgchat.engine.core` (the engine build), after it wrote its
pid to a file, so the signal lands while the model is loading, every time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_signals import default_signals

from fgchat.serve.launch import CLI

GATE_ENV = "FGCHAT_TEST_LOAD_GATE"
SITECUSTOMIZE = f'''
import os, sys, time

class _HoldTheEngineBuild:
    def find_spec(self, name, path=None, target=None):
        if name == "fgchat.engine.core":
            with open(os.environ["{GATE_ENV}"], "w") as f:
                f.write(str(os.getpid()))
            while True:
                time.sleep(1)
        return None

if os.environ.get("{GATE_ENV}") and "--multiprocessing-fork" in sys.argv:
    sys.meta_path.insert(0, _HoldTheEngineBuild())
elif os.environ.get("{GATE_ENV}"):  # the server: SIGUSR1 dumps its threads' stacks (a stop that hangs)
    import faulthandler, signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
'''


def _wait_for_pid(path: Path, proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"the engine process did not start its build (server status {proc.poll()})")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_stops_cleanly(tiny_llama, tmp_path, sig):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    gate = tmp_path / "engine.pid"
    env = {**os.environ, GATE_ENV: str(gate),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--port", "0", "--model", str(tiny_llama),
                             "--device", "cpu", "--max-context", "256"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=default_signals)
    engine = None
    try:
        engine = _wait_for_pid(gate, proc, 120)
        proc.send_signal(sig)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # where it hangs, on its stderr
            time.sleep(1)
            proc.kill()
            os.kill(engine, signal.SIGKILL)  # it holds the stderr pipe open too
            raise AssertionError("the server did not stop within 30 s:\n" + proc.communicate(timeout=30)[1]) from None
        engine_gone = _gone(engine, 10)
        if not engine_gone:
            os.kill(engine, signal.SIGKILL)  # else its resource tracker keeps stderr open
        err = proc.communicate(timeout=30)[1]
        assert rc == 0, err
        lines = err.splitlines()
        assert lines and lines[-1] == f"fgchat serve: stopped by {sig.name} before the model finished loading", err
        assert all(line.startswith("fgchat serve: ") for line in lines), err  # no traceback, no warning
        assert engine_gone, "the engine process outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if engine is not None and not _gone(engine, 0.1):
            os.kill(engine, signal.SIGKILL)
