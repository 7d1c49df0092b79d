"""EndpointClient against a `fgchat serve` whose engine fails one reply of an n=2 request (the
server of test_serve_choice_errors): that reply alone fails (EngineError, then RequestFinished
"error" with its partial text); its sibling finishes normally."""

from __future__ import annotations

from test_client import HI, collect, finished, started
from test_serve_choice_errors import AFTER, ALL_SEED, MESSAGE, PARTIAL_SEED, server  # noqa: F401 (fixture)

from fgchat.client import EndpointClient
from fgchat.protocol.events import EngineError, RequestFinished, SamplingParams, TokenEvent


def _two_replies(server, seed: int) -> list:
    """The events of one n=2 request with seeds seed and seed + 1, until both replies ended."""
    h = EndpointClient(server.base)
    try:
        started(h)
        h.submit_chats(HI, [(1, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=seed)),
                            (2, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=seed + 1))])
        evs = collect(h, finished([1, 2]))
        assert not h.failed
        return evs
    finally:
        h.shutdown()


def test_a_failed_choice_fails_alone(server):  # noqa: F811
    evs = _two_replies(server, PARTIAL_SEED)
    ends = {e.summary.request_id: e.summary for e in evs if isinstance(e, RequestFinished)}
    errors = [e for e in evs if isinstance(e, EngineError)]
    assert ends[1].finish_reason == "length" and ends[1].output_tokens == 10
    assert ends[2].finish_reason == "error" and ends[2].output_tokens == AFTER
    assert [(e.request_id, e.fatal) for e in errors] == [(2, False)] and MESSAGE in errors[0].message
    assert ends[2].text == "".join(e.text for e in evs if isinstance(e, TokenEvent) and e.request_id == 2)


def test_every_choice_failed(server):  # noqa: F811
    evs = _two_replies(server, ALL_SEED)
    ends = {e.summary.request_id: e.summary.finish_reason for e in evs if isinstance(e, RequestFinished)}
    errors = [e for e in evs if isinstance(e, EngineError)]
    assert ends == {1: "error", 2: "error"}
    assert sorted(e.request_id for e in errors) == [1, 2]  # once each, not again for the request's error
    assert all(MESSAGE in e.message and not e.fatal for e in errors)
