"""`fgchat serve` on the scripted model (tests/scripted_model.py), whose replies are known: the
reply ends at the model's EOS with finish_reason "stop"; the system (or developer) message reaches
the prompt; sampling filters and penalties sent in a request are applied; when two stop strings
match, the earliest wins and the text is cut right before it. Also StopMatcher by itself."""

from __future__ import annotations

import httpx
import openai
import pytest

import scripted_model as sm
from fgchat.serve.launch import start_server
from fgchat.serve.stops import StopMatcher

pytestmark = pytest.mark.timeout(180)

MODEL = "scripted"
HI = [{"role": "user", "content": "hi"}]
PIRATE = [{"role": "system", "content": "you are a pirate."}, {"role": "user", "content": "hi"}]
COUNT_TEXT = "one two three four five six seven eight"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = sm.build_scripted_model(tmp_path_factory.mktemp("serve") / MODEL)
    srv = start_server(["--model", str(model), "--device", "cpu", "--max-context", "256"])
    yield srv
    assert srv.stop() == 0, srv.lines[-5:]


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **kw).choices[0]


def streamed(client, messages, **kw) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


def test_a_reply_ends_at_eos_with_the_system_and_developer_message_in_the_prompt(client):
    plain = chat(client, HI)
    assert plain.message.content == "hello world" and plain.finish_reason == "stop"
    assert streamed(client, HI) == ("hello world", "stop")
    for role in ("system", "developer"):
        pirate = chat(client, [{"role": role, "content": "you are a pirate."}, *HI])
        assert pirate.message.content == "arr matey" and pirate.finish_reason == "stop", role
    raw = client.completions.create(model=MODEL, prompt="count", max_tokens=12).choices[0]
    assert raw.text == COUNT_TEXT and raw.finish_reason == "stop"


def test_roles_out_of_order_are_the_templates_400(server):
    body = {"model": MODEL, "messages": [*HI, *HI], "max_tokens": 4}
    r = httpx.post(f"{server.base}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]


def test_request_filters_and_penalties_are_applied(client, server):
    """At temperature 100 every token is about as likely: top-k 1 or a tiny top-p must give the
    chain; "echo" repeats greedily unless a penalty sent in the request breaks it."""
    hot = dict(temperature=100.0, seed=5)
    assert chat(client, HI, **hot).message.content != "hello world"
    assert chat(client, HI, top_p=0.001, **hot).message.content == "hello world"
    assert chat(client, HI, extra_body={"top_k": 1}, **hot).message.content == "hello world"
    echo = {"model": MODEL, "prompt": "echo", "max_tokens": 4}
    plain = httpx.post(f"{server.base}/completions", json=echo, timeout=60).json()["choices"][0]
    assert plain["text"] == "echo echo echo echo" and plain["finish_reason"] == "length"
    for penalty, text in (({"repetition_penalty": 1.5}, "done"), ({"presence_penalty": 2.0}, "echo done"),
                          ({"frequency_penalty": 1.5}, "echo done")):
        r = httpx.post(f"{server.base}/completions", json={**echo, **penalty}, timeout=60).json()["choices"][0]
        assert (r["text"], r["finish_reason"]) == (text, "stop"), penalty


@pytest.mark.parametrize("stops, cut", [
    (["world", "o w"], "hell"),  # both in the same delta: the earlier one, listed last
    (["o w", "world"], "hell"),
    (["d", "hello"], ""),
])
def test_two_stop_strings_the_earliest_wins(client, stops, cut):
    whole = chat(client, HI, stop=stops)
    assert (whole.message.content, whole.finish_reason) == (cut, "stop")
    assert streamed(client, HI, stop=stops) == (cut, "stop")


def test_two_stop_strings_across_deltas(client):
    """"two three" starts before "o t" and both complete with the delta " three"."""
    r = client.completions.create(model=MODEL, prompt="count", max_tokens=12, stop=["o t", "two three"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("one ", "stop")
    r = client.completions.create(model=MODEL, prompt="count", max_tokens=12, stop=["four", "two"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("one ", "stop")


@pytest.mark.parametrize("stops, deltas, released", [
    (["world", "o w"], ["hello world"], "hell"),
    (["o w", "world"], ["hello", " world"], "hell"),
    (["abcd", "bc"], ["xab", "cd", "ef"], "x"),  # the held "ab" decides: "abcd" at 0 before "bc" at 1
    (["bc", "abcd"], ["xab", "c", "d"], "xa"),  # "bc" completes first: "abcd" never does
    (["cd", "bcd"], ["ab", "cdx"], "a"),  # the longer one that starts earlier wins over the one inside it
])
def test_stop_matcher_two_matches(stops, deltas, released):
    m = StopMatcher(stops)
    out = "".join(m.feed(d) for d in deltas)
    assert out + m.flush() == released and m.matched
