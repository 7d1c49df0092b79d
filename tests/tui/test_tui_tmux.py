"""The real TUI in a real terminal (tmux), on the embedded model: K = 4 replies run as one batch.

Drives `fgchat --log-csv` in a tmux session with keys only (F4 x3, a prompt, Enter, ctrl+q), then
reads the --log-csv file and the chat store: decode steps at batch size 4 appear, and the four
replies' TTFTs (stored with each reply) are within 10% of each other, because the four requests
reach the engine in one message and are prefilled in one round.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400),
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

SESSION = f"fgchat-k4-{os.getpid()}"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30).stdout


def screen() -> str:
    return tmux("capture-pane", "-p", "-t", SESSION)


def wait_until(cond, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; screen:\n{screen()}")
        time.sleep(0.25)


def test_k4_replies_decode_as_one_batch_in_tmux(tmp_path):
    from fgchat.protocol.errors import ModelLoadError
    from fgchat.engine.model.resolve import embedded_gguf_path

    try:
        embedded_gguf_path()
    except ModelLoadError:
        pytest.skip("embedded model not installed")
    data, log = tmp_path / "data", tmp_path / "tokens.csv"
    cmd = (f"cd {Path(__file__).resolve().parents[2]} && FGCHAT_DATA_DIR={data} "
           f"{sys.executable} -m fgchat.cli --device cpu --mode eager --log-csv {log}")
    tmux("new-session", "-d", "-s", SESSION, "-x", "150", "-y", "45", cmd)
    try:
        wait_until(lambda: "SmolLM2" in screen() and "engine starting" not in screen(), "the engine", 300)
        for _ in range(3):
            tmux("send-keys", "-t", SESSION, "F4")
            time.sleep(0.3)
        wait_until(lambda: "K 4" in screen() or "K=4" in screen(), "K = 4 shown", 30)
        tmux("send-keys", "-t", SESSION, "-l", "What is the capital of France?")
        tmux("send-keys", "-t", SESSION, "Enter")

        def rows() -> list[dict]:
            if not log.exists():
                return []
            with open(log, newline="") as f:
                return list(csv.DictReader(f))

        wait_until(lambda: any(r["batch_size"] == "4" for r in rows()), "a decode step at batch 4", 120)
        from fgchat.tui.store import ChatStore

        def finished() -> list:
            try:
                store = ChatStore(data / "chats.sqlite3", read_only=True)
                try:
                    chats = store.list_conversations()
                    conv = store.load(chats[0].id) if chats else None
                finally:
                    store.close()
            except Exception:  # not created yet, or busy
                return []
            return [m for m in conv.messages if m.role == "assistant"] if conv else []

        wait_until(lambda: len(finished()) == 4, "four finished replies in the store", 240)
        time.sleep(1.0)
    finally:
        tmux("send-keys", "-t", SESSION, "C-q")
        deadline = time.monotonic() + 20
        while SESSION in tmux("ls") and time.monotonic() < deadline:
            time.sleep(0.25)
        tmux("kill-session", "-t", SESSION)
    replies = finished()
    assert len(replies) == 4
    ttfts = [m.meta.get("ttft_ms") for m in replies]
    assert all(t is not None for t in ttfts), [m.meta for m in replies]
    assert max(ttfts) <= 1.10 * min(ttfts), ttfts
    batch4 = [r for r in rows() if r["batch_size"] == "4"]
    assert len({r["request_id"] for r in batch4}) == 4
