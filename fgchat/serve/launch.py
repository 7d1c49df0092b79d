"""Run `fgchat serve` as a child process on a free port and wait until it answers /health.

For tests, the load test and benchmarks on this machine. The child's stderr is drained on a
thread (kept in `lines`), so a chatty server never blocks on a full pipe.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx

LISTEN_RE = re.compile(r"listening on (http://\S+?)/v1")
CLI = "import sys; from fgchat.cli import main; sys.exit(main())"


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, api_key: str | None = None) -> None:
        self.proc = proc
        self.api_key = api_key
        self.root = ""
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def base(self) -> str:
        return f"{self.root}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = LISTEN_RE.search(line)
            if m and not self.root:
                self.root = m.group(1)
                self._listening.set()
        self._listening.set()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not self._listening.wait(timeout) or not self.root:
            self.stop()
            raise RuntimeError("fgchat serve did not start: " + " | ".join(self.lines[-5:]))
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.root}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("fgchat serve did not become healthy in time")

    def rss_kib(self, children: bool = False) -> int:
        """Resident memory in KiB of the server process, or (children) of its child processes
        (the engine); 0 when gone. Linux /proc only."""
        pids = [self.proc.pid]
        if children:
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                return 0
        return sum(_rss_kib(pid) for pid in pids)

    def kill(self) -> None:
        """SIGKILL, as a crash would (its engine child notices the parent is gone and exits)."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def start_server(args: list[str], *, api_key: str | None = None, port: int = 0,
                 timeout: float = 180.0) -> ServerProcess:
    """`fgchat serve --port PORT ARGS...` (port 0: a free one), ready to take requests."""
    cmd = [sys.executable, "-c", CLI, "serve", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, encoding="utf-8", errors="replace")
    server = ServerProcess(proc, api_key)
    server.wait_ready(timeout)
    return server
