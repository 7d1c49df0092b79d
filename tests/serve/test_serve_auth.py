"""`fgchat serve --api-key`: Bearer auth on every route but /health (its own server process)."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from fgchat.protocol.errors import FgchatError
from fgchat.serve.launch import start_server

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(["--model", str(tiny_llama), "--device", "cpu", "--max-context", "256"], api_key=KEY)
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                          ("GET", "/metrics"), ("GET", "/fgchat/info"), ("POST", "/fgchat/mode")])
def test_routes_need_the_key(server, method, path, headers):
    r = httpx.request(method, server.root + path, headers=headers, json={})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and KEY not in r.text


def test_health_is_open_and_the_key_works(server):
    assert httpx.get(f"{server.root}/health").status_code == 200
    client = openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base, api_key="nope", max_retries=0).models.list()


def test_endpoint_client_sends_the_key(server):
    from fgchat.client import EndpointClient
    from fgchat.protocol.events import EngineError, EngineInfo

    for key, want in ((KEY, EngineInfo), ("bad-key-xyz", EngineError)):
        h = EndpointClient(server.base, api_key=key)
        h.start()
        evs: list = []
        while not evs:
            evs = h.get_events(1.0)
        h.shutdown()
        assert isinstance(evs[0], want), evs
        if want is EngineError:
            assert evs[0].fatal and "401" in evs[0].message and "bad-key-xyz" not in evs[0].message


def test_an_empty_api_key_names_where_it_came_from(monkeypatch):
    from fgchat.serve.run import API_KEY_ENV, api_key_for

    monkeypatch.setenv(API_KEY_ENV, "a b")
    with pytest.raises(FgchatError, match=API_KEY_ENV):
        api_key_for(argparse.Namespace(api_key=None))
    with pytest.raises(FgchatError, match="--api-key"):
        api_key_for(argparse.Namespace(api_key=""))
