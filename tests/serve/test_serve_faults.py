"""`fgchat serve` when its engine process dies: the stream in flight ends with an error event,
/health says 503, new requests get 503 JSON, and the server itself keeps answering and exits 0."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from fgchat.serve.launch import start_server


def _engine_pid(server) -> int:
    pid = server.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    for kid in kids:
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                return kid
    raise AssertionError(f"no engine child among {kids}")


def test_engine_death_is_503_not_a_dead_server(tiny_llama):
    srv = start_server(["--model", str(tiny_llama), "--device", "cpu", "--max-context", "1024"])
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{srv.base}/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(_engine_pid(srv), signal.SIGKILL)
            rest = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
        assert rest[-1] == "[DONE]"
        errors = [json.loads(d)["error"] for d in rest[:-1] if "error" in json.loads(d)]
        assert len(errors) == 1 and "engine" in errors[0]["message"]
        deadline = time.monotonic() + 10
        while httpx.get(f"{srv.root}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{srv.root}/health")
        assert health.status_code == 503 and "engine stopped" in health.json()["error"]["message"]
        r = httpx.post(f"{srv.base}/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{srv.base}/models").status_code == 200
    finally:
        assert srv.stop() == 0


def test_sigterm_ends_the_streams_in_flight_and_exits_0(tiny_llama):
    srv = start_server(["--model", str(tiny_llama), "--device", "cpu", "--max-context", "2048"])
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{srv.base}/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data:")
            srv.proc.send_signal(signal.SIGTERM)
            rest = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
        assert rest[-1] == "[DONE]"  # the stream ends whole, not cut off by the shutdown
        chunks = [json.loads(d) for d in rest[:-1]]
        errors = [ch["error"] for ch in chunks if "error" in ch]
        assert len(errors) == 1 and "shutting down" in errors[0]["message"]
        assert chunks[-1]["usage"]["completion_tokens"] < 2000
        assert srv.proc.wait(10) == 0
        assert not any("Traceback" in line for line in srv.lines), srv.lines[-5:]
    finally:
        srv.stop()
