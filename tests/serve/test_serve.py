"""`fgchat serve` end to end: a real server process on localhost with a tiny model on CPU, used
through the `openai` client and raw HTTP (one server shared by the module's tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from fgchat.serve.launch import CLI, start_server

MAX_CONTEXT = 2048
MODEL = "llama"  # the tiny model's directory name


@pytest.fixture(scope="module")
def server(tiny_llama):
    # --max-queue 0: capacity is exactly the engine's 8 slots, so a slot not freed shows as a 429
    srv = start_server(["--model", str(tiny_llama), "--device", "cpu", "--max-context", str(MAX_CONTEXT),
                        "--max-queue", "0"])
    yield srv
    assert srv.stop() == 0, srv.lines[-5:]


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)


def _chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Hello there!"}], **kw}


def _idle(server, timeout: float = 5.0) -> dict:
    """Wait until the server has no request in flight; return its last /health."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{server.root}/health").json()
        if health["running"] == 0 and health["waiting"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_openai_client_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_client_retrieves_the_served_model(client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_openai_client_streaming_n2_carries_timing(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, stream=True,
        temperature=0.8, seed=3, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text = {0: "", 1: ""}
    finish, timings = {}, []
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        extra = (chunk.model_extra or {}).get("fgchat")
        if extra:
            timings.append(extra)
        for ch in chunk.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 10
    assert len(timings) == 10 and {t["mode"] for t in timings} == {"eager"}
    assert max(t["batch_size"] for t in timings) == 2  # the two choices decode as one batch
    assert all(t["itl_ms"] is None for t in timings if t["token_index"] == 0)
    assert all(t["itl_ms"] > 0 for t in timings if t["token_index"] > 0)


def test_seeded_sampling_reproducible_and_defaults_greedy(client):
    a, b = (client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8, temperature=1.0, seed=11) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content
    g1, g2 = (client.completions.create(model=MODEL, prompt="The capital of", max_tokens=8) for _ in range(2))
    assert g1.choices[0].text == g2.choices[0].text  # the tiny model's defaults: greedy


def test_completions_stop_string_cuts_and_frees(client, server):
    full = client.completions.create(model=MODEL, prompt="The capital", max_tokens=40,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 6
    stop = full[3:5]
    cut = client.completions.create(model=MODEL, prompt="The capital", max_tokens=40, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital", max_tokens=40, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].text
    assert _idle(server)["running"] == 0  # the engine request was cancelled at the stop string


def test_a_reply_cut_by_a_stop_string_keeps_its_timing(server):
    body = {"prompt": "The capital", "max_tokens": 40, "ignore_eos": True}
    full = httpx.post(f"{server.base}/completions", json=body, timeout=60).json()["choices"][0]["text"]
    r = httpx.post(f"{server.base}/completions", json={**body, "n": 2, "stop": full[3:5]}, timeout=60).json()
    assert [c["finish_reason"] for c in r["choices"]] == ["stop", "stop"]
    for t in r["fgchat"]["choices"]:  # the engine's numbers for the cancelled request
        assert t is not None and 0 < t["ttft_ms"] <= t["e2e_ms"], r["fgchat"]
    assert _idle(server)["running"] == 0


@pytest.mark.parametrize("body, status, needle", [
    (b'{"messages": [', 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "NaN"),
    (json.dumps(_chat(bogus=1)).encode(), 400, "unknown field 'bogus'"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
    (json.dumps(_chat(temperature=-1)).encode(), 400, "temperature"),
    (json.dumps(_chat(top_p=0)).encode(), 400, "top-p"),
    (json.dumps(_chat(presence_penalty=5)).encode(), 400, "presence penalty"),
    (json.dumps(_chat(n=9)).encode(), 400, "n"),
    (json.dumps(_chat(max_tokens=0)).encode(), 400, "max_tokens"),
    (json.dumps(_chat(stop=["a", "b", "c", "d", "e"])).encode(), 400, "stop"),
    (json.dumps(_chat(model="gpt-4")).encode(), 404, "does not exist"),
    (json.dumps({"messages": []}).encode(), 400, "messages"),
    (json.dumps(_chat(stream="yes")).encode(), 400, "stream"),  # no coercion of wrong types
    (json.dumps(_chat(n="2")).encode(), 400, "n"),
    (json.dumps(_chat(max_tokens=3.0)).encode(), 400, "max_tokens"),
    (json.dumps(_chat(temperature="0.5")).encode(), 400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
                ).encode(), 400, "messages.0.content: content parts of type 'image_url' are not supported"),
    (json.dumps(_chat(logprobs=True)).encode(), 400, "logprobs is not supported"),
    (json.dumps(_chat(top_logprobs=2)).encode(), 400, "top_logprobs is not supported"),
    (json.dumps(_chat(store=True)).encode(), 400, "store is not supported"),
    (json.dumps(_chat(response_format={"type": "json_object"})).encode(), 400,
     "response_format type 'json_object' is not supported"),
    # a lone surrogate (JSON can escape one; no text encoding takes it): the field and the problem
    (json.dumps({"messages": [{"role": "user", "content": "hi \ud800 there"}]}).encode(), 400,
     "messages.0.content is not valid Unicode: it contains a lone surrogate (\\ud800) at character 3"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}).encode(),
     400, "messages.0.content.0.text is not valid Unicode"),
    (json.dumps(_chat(stop=["ok", "x\udfff"])).encode(), 400, "stop.1 is not valid Unicode"),
])
def test_bad_requests_are_4xx_in_openai_shape(server, body, status, needle):
    r = httpx.post(f"{server.base}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and "\n" not in err["message"]
    if "Unicode" in needle:
        assert err["param"] == needle.split(" ")[0] and "Error" not in err["message"]


def test_logprobs_off_is_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, logprobs=False, top_logprobs=None)
    assert r.choices[0].logprobs is None
    c = client.completions.create(model=MODEL, prompt="The capital", max_tokens=2, logprobs=0)
    assert c.choices[0].logprobs is None


def test_fields_clients_send_with_harmless_values_are_accepted(client):
    """What SDKs and frameworks send by default: no stored completion, plain text, no tools."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       store=False, metadata={"run": "a"}, response_format={"type": "text"},
                                       parallel_tool_calls=True)
    assert r.choices[0].message.content is not None


def test_prompt_longer_than_context_is_400_stream_or_not(server):
    long = "hello " * (MAX_CONTEXT + 100)
    for stream in (False, True):
        r = httpx.post(f"{server.base}/chat/completions", json=_chat(stream=stream, messages=[
            {"role": "user", "content": long}]), timeout=60)
        assert r.status_code == 400, r.text
        assert "context" in r.json()["error"]["message"]


def test_oversized_body_is_413_and_server_lives(server):
    r = httpx.post(f"{server.base}/chat/completions", content=b"x" * (1 << 20 + 1) + b"x" * 10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert httpx.get(f"{server.root}/health").status_code == 200
    assert httpx.get(f"{server.root}/nope").json()["error"]["type"] == "not_found_error"


def test_disconnect_mid_stream_frees_the_slot(server):
    body = _chat(stream=True, max_tokens=MAX_CONTEXT - 100, ignore_eos=True)
    streams = []
    with httpx.Client(timeout=60) as c:
        for _ in range(8):  # fill all 8 slots with long generations (tens of seconds each)
            resp = c.send(c.build_request("POST", f"{server.base}/chat/completions", json=body), stream=True)
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept alive: a collected line iterator closes its response
            assert next(lines).startswith("data:")
            streams.append((resp, lines))
        assert httpx.post(f"{server.base}/chat/completions", json=_chat(max_tokens=2)).status_code == 429
        for resp, _ in streams:
            resp.close()
    health = _idle(server, timeout=5.0)
    assert health["running"] == 0 and health["waiting"] == 0, health
    with httpx.Client(timeout=60) as c:  # 8 new requests all run
        got = [c.post(f"{server.base}/chat/completions", json=_chat(max_tokens=3)) for _ in range(8)]
    assert [r.status_code for r in got] == [200] * 8


def test_mode_switch_and_metrics(server):
    r = httpx.post(f"{server.root}/fgchat/mode", json={"mode": "full"}, timeout=60)
    assert r.status_code == 200 and r.json()["mode"] == "eager" and "CUDA" in r.json()["reason"]
    assert httpx.post(f"{server.root}/fgchat/mode", json={"mode": "warp"}).status_code == 400
    info = httpx.get(f"{server.root}/fgchat/info").json()
    assert info["model_name"] == MODEL and info["max_context"] == MAX_CONTEXT
    httpx.post(f"{server.base}/chat/completions", json=_chat(max_tokens=4, ignore_eos=True), timeout=60)
    text = httpx.get(f"{server.root}/metrics").text
    for name in ("fgchat:time_to_first_token_seconds_count{mode=\"eager\"}",
                 "fgchat:inter_token_latency_seconds_bucket", "fgchat:batch_size_bucket",
                 "fgchat:num_requests_waiting", "fgchat:num_requests_running",
                 "fgchat:request_rejected_total", "fgchat:engine_mode{mode=\"eager\"} 1.0"):
        assert name in text, name
    ttft = [line for line in text.splitlines() if line.startswith('fgchat:time_to_first_token_seconds_count{mode="eager"}')]
    assert float(ttft[0].split()[-1]) >= 1


def test_non_loopback_host_without_key_is_refused():
    r = subprocess.run([sys.executable, "-c", CLI, "serve", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--api-key" in r.stderr and "Traceback" not in r.stderr


def test_busy_port_is_one_line(server):
    port = server.root.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-c", CLI, "serve", "--port", port], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot listen" in r.stderr, r.stderr


def test_stop_matcher_across_deltas():
    from fgchat.serve.stops import StopMatcher

    m = StopMatcher(["END", "xy"])
    out = [m.feed(d) for d in ("ab", "cE", "N", "x", "zE", "ND", "more")]
    assert "".join(out) == "abcENxz" and m.matched  # cut before "END"; nothing after it
    assert out[1] == "c" and out[2] == ""  # "E", then "EN" held back until decided
    m2 = StopMatcher(["END"])
    assert m2.feed("aEN") == "a" and m2.flush() == "EN" and not m2.matched


def test_the_next_turn_reports_the_prompt_tokens_it_did_not_prefill_again(client, server):
    first = [{"role": "user", "content": " ".join(f"word{i}" for i in range(60))}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8)
    assert r1.usage.prompt_tokens_details is None or not r1.usage.prompt_tokens_details.cached_tokens
    _idle(server)
    nxt = first + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
    r2 = client.chat.completions.create(model=MODEL, messages=nxt, max_tokens=8)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens
