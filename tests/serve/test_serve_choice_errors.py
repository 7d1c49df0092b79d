"""`fgchat serve` when the engine fails one choice of a request with n > 1, used through the real
`openai` client: the failed choice ends with finish_reason "error" and its message, the other
choices stream on to their end, and only a request whose every choice failed is an error (the
openai client raises it; a non-streamed request gets a 503).

The server is the real `fgchat serve` process on the tiny model, except that its engine runs on a
thread of the server (EngineThread) and is wrapped so that a reply whose seed is listed in
$FGCHAT_TEST_FAIL_SEEDS ends with an engine error after $FGCHAT_TEST_FAIL_AFTER tokens (one whose
seed is $FGCHAT_TEST_FAIL_FIRST_SEED before its first token, as a failed prefill does), with the
events a per-request engine failure makes (EngineError, then RequestFinished "error")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from fgchat.serve.launch import ServerProcess

MODEL = "llama"
AFTER = 3  # tokens a failing reply streams before its error
MAX_TOKENS = 12
PARTIAL_SEED = 100  # choice 1 (seed 101) fails, choice 0 (seed 100) does not
ALL_SEED = 200  # choices 0 and 1 (seeds 200, 201) both fail
FAIL_SEEDS = (PARTIAL_SEED + 1, ALL_SEED, ALL_SEED + 1)
FIRST_SEED = 300  # fails before its first token
MESSAGE = "engine step failed: RuntimeError: injected for this reply"

FAULTY_SERVE = f'''
import dataclasses, os, sys
from fgchat.engine import process
from fgchat.protocol.events import EngineError, RequestFinished, TokenEvent

FAIL_SEEDS = {{int(s) for s in os.environ["FGCHAT_TEST_FAIL_SEEDS"].split(",")}}
AFTER = int(os.environ["FGCHAT_TEST_FAIL_AFTER"])
FIRST = int(os.environ["FGCHAT_TEST_FAIL_FIRST_SEED"])


class FailingReplies:
    def __init__(self, engine):
        self._engine = engine
        self._doomed = set()  # request ids that fail once they have AFTER tokens
        self._failing = set()  # cancelled: their RequestFinished becomes the error
        self._at_first = set()  # request ids that fail at their first token, none of their tokens sent

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, prompt_ids, params=None, request_id=None):
        rid = self._engine.submit(prompt_ids, params, request_id)
        if params is not None and params.seed in FAIL_SEEDS:
            self._doomed.add(rid)
        if params is not None and params.seed == FIRST:
            self._at_first.add(rid)
        return rid

    def has_work(self):
        return bool(self._failing) or self._engine.has_work()

    def step(self):
        out = []
        for ev in self._engine.step():
            if isinstance(ev, RequestFinished) and ev.summary.request_id in self._failing:
                self._failing.discard(ev.summary.request_id)
                self._at_first.discard(ev.summary.request_id)
                out += [EngineError({MESSAGE!r}, ev.summary.request_id),
                        dataclasses.replace(ev, summary=dataclasses.replace(ev.summary, finish_reason="error"))]
                continue
            if isinstance(ev, TokenEvent) and ev.request_id in self._at_first:  # none of its tokens is sent
                if ev.request_id not in self._failing:
                    self._failing.add(ev.request_id)
                    self._engine.cancel(ev.request_id)
                continue
            out.append(ev)
            if isinstance(ev, TokenEvent) and ev.request_id in self._doomed and ev.token_index + 1 >= AFTER:
                self._doomed.discard(ev.request_id)
                self._failing.add(ev.request_id)
                self._engine.cancel(ev.request_id)
        return out


def engine_thread(config):
    from fgchat.engine.core import Engine
    build = lambda: FailingReplies(Engine(process.engine_process_config(config)))
    return process.EngineThread(config, make_engine=build)


process.EngineProcess = engine_thread
from fgchat.cli import main
sys.exit(main())
'''


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {**os.environ, "FGCHAT_TEST_FAIL_SEEDS": ",".join(map(str, FAIL_SEEDS)),
           "FGCHAT_TEST_FAIL_AFTER": str(AFTER), "FGCHAT_TEST_FAIL_FIRST_SEED": str(FIRST_SEED)}
    proc = subprocess.Popen([sys.executable, "-c", FAULTY_SERVE, "serve", "--port", "0", "--model", str(tiny_llama),
                             "--device", "cpu", "--max-context", "512"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, encoding="utf-8", errors="replace", env=env)
    srv = ServerProcess(proc)
    srv.wait_ready(180)
    yield srv
    assert srv.stop() == 0, srv.lines[-5:]


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)


def _request(seed: int, **kw) -> dict:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "n": 2, "seed": seed, "temperature": 0.8,
            "extra_body": {"ignore_eos": True}, **kw}


def _collect(stream) -> tuple[dict, dict, dict, dict, list]:
    """Per choice index: text, finish_reason, error (the choice's `error` field), token chunks;
    and the usage objects seen."""
    text: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    errors: dict[int, dict] = {}
    tokens: dict[int, int] = {0: 0, 1: 0}
    usage = []
    for chunk in stream:
        if chunk.usage:
            usage.append(chunk.usage)
        for ch in chunk.choices:
            part = ch.delta.content if hasattr(ch, "delta") else ch.text
            text[ch.index] += part or ""
            if (chunk.model_extra or {}).get("fgchat"):
                tokens[ch.index] += 1
            if ch.finish_reason:
                assert ch.index not in finish, f"choice {ch.index} finished twice"
                finish[ch.index] = ch.finish_reason
                if (ch.model_extra or {}).get("error"):
                    errors[ch.index] = ch.model_extra["error"]
    return text, finish, errors, tokens, usage


@pytest.mark.parametrize("chat", [True, False])
def test_one_failed_choice_does_not_end_the_stream(client, chat):
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=True,
                                                stream_options={"include_usage": True}, **_request(PARTIAL_SEED))
    else:
        stream = client.completions.create(prompt="The capital of", stream=True,
                                           stream_options={"include_usage": True}, **_request(PARTIAL_SEED))
    text, finish, errors, tokens, usage = _collect(stream)  # the openai client raises nothing
    assert finish == {0: "length", 1: "error"}
    assert tokens == {0: MAX_TOKENS, 1: AFTER}  # choice 0 streamed to its end after choice 1 failed
    assert text[0] and text[1]
    assert list(errors) == [1] and errors[1]["message"] == MESSAGE and errors[1]["code"] == "engine_error"
    assert len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS + AFTER


def test_every_choice_failed_is_an_error_the_client_raises(client):
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=True,
                                            **_request(ALL_SEED))
    finish = {}
    with pytest.raises(openai.APIError, match="injected for this reply"):
        for chunk in stream:
            for ch in chunk.choices:
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
    assert finish == {0: "error", 1: "error"}  # each choice ended before the request's error


def test_the_raw_stream_of_a_partly_failed_request(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "n": 2, "seed": PARTIAL_SEED,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.base}/chat/completions", json=body) as resp:
        data = [ln[5:].strip() for ln in resp.iter_lines() if ln.startswith("data:")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert not any("error" in ch for ch in chunks)  # no top-level error: the request did not fail
    ends = [c for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert [(c["index"], c["finish_reason"]) for c in ends] == [(1, "error"), (0, "length")]
    assert ends[0]["delta"] == {} and ends[0]["error"]["message"] == MESSAGE
    assert "usage" in chunks[-1]


def test_non_streamed_partial_failure_keeps_the_good_choice(client):
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **_request(PARTIAL_SEED))
    by_index = {c.index: c for c in r.choices}
    assert by_index[0].finish_reason == "length" and by_index[0].message.content
    assert by_index[1].finish_reason == "error" and by_index[1].model_extra["error"]["message"] == MESSAGE
    assert r.usage.completion_tokens == MAX_TOKENS + AFTER
    with pytest.raises(openai.InternalServerError, match="injected for this reply") as exc:
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **_request(ALL_SEED))
    assert exc.value.status_code == 503


def test_the_server_takes_requests_after_failed_choices(client, server):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       n=2, seed=7, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    health = httpx.get(f"{server.root}/health").json()
    assert health["running"] == 0 and health["waiting"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_before_the_first_token_a_failed_request_is_503_and_a_refused_one_400(client, stream):
    """The engine failing a request before its first token (a failed prefill) is the server's
    error, 503; a request it refuses as sent (a prompt past the context) is the client's, 400."""
    with pytest.raises(openai.InternalServerError, match="generation failed: .*injected") as failed:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=stream,
                                           **_request(FIRST_SEED, n=1))
        list(r) if stream else r
    assert failed.value.status_code == 503
    with pytest.raises(openai.BadRequestError, match="context") as refused:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "word " * 600}], stream=stream,
                                           **_request(7, n=1))
        list(r) if stream else r
    assert refused.value.status_code == 400
