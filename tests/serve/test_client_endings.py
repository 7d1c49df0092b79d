"""EndpointClient against scripted OpenAI-compatible servers that are not fgchat (fake_openai.py):
each choice of an n=2 request ends on its own finish_reason, a server that ignores `n` gets the
replies it left out as requests of their own, and tokens of a server that does not say how it runs
are labelled `remote`."""

from __future__ import annotations

from fake_openai import FakeServer
from test_client import HI, collect, finished, started

from fgchat.client import EndpointClient
from fgchat.protocol.events import REMOTE_MODE, EngineError, RequestFinished, RequestNotice, SamplingParams, TokenEvent

TWO = [(1, SamplingParams(max_tokens=50, temperature=0.8, seed=5)),
       (2, SamplingParams(max_tokens=50, temperature=0.8, seed=6))]


def _ends(evs: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for e in evs:
        if isinstance(e, RequestFinished):
            out.setdefault(e.summary.request_id, []).append(e.summary)
    return out


def test_a_choice_ends_on_its_own_finish_reason_while_its_sibling_streams():
    with FakeServer("early") as fake:
        h = EndpointClient(fake.base)
        try:
            info = started(h)
            assert info.mode == REMOTE_MODE
            h.submit_chats(HI, TWO)
            evs = collect(h, lambda evs: bool(_ends(evs).get(1)), 10)
            assert 2 not in _ends(evs), "reply 1 ended only with the whole stream"
            first = _ends(evs)[1][0]
            assert first.finish_reason == "stop" and first.output_tokens == 3 and first.text == " w0 w1 w2"
            assert first.tpot_ms is not None and first.tpot_ms < 500  # its own tokens, not the stream's end
            h.cancel(1)  # e.g. Esc while reply 2 still streams: reply 1 is over, it stays "stop"
            evs += collect(h, finished([1, 2]), 10)
            after = evs.index(next(e for e in evs if isinstance(e, RequestFinished)))
            assert any(isinstance(e, TokenEvent) and e.request_id == 2 for e in evs[after:])  # 2 still streamed
            ends = _ends(evs)
            assert [s.finish_reason for s in ends[1]] == ["stop"]  # once, never "cancelled"
            assert [s.finish_reason for s in ends[2]] == ["length"] and ends[2][0].output_tokens == 12
            assert not any(isinstance(e, EngineError) for e in evs)
            toks = [e for e in evs if isinstance(e, TokenEvent)]
            assert {t.mode for t in toks} == {REMOTE_MODE}  # nothing says the server ran "eager"
        finally:
            h.shutdown()


def test_a_server_that_ignores_n_gets_each_reply_as_its_own_request():
    with FakeServer("ignore_n", tokens=4) as fake:
        h = EndpointClient(fake.base)
        try:
            started(h)
            h.submit_chats(HI, TWO)
            evs = collect(h, finished([1, 2]), 15)
            ends = _ends(evs)
            assert not any(isinstance(e, EngineError) for e in evs), [e for e in evs if isinstance(e, EngineError)]
            assert {rid: [s.finish_reason for s in ss] for rid, ss in ends.items()} == {1: ["length"], 2: ["length"]}
            assert ends[2][0].output_tokens == 4 and ends[2][0].text == " w0 w1 w2 w3"
            notices = [e for e in evs if isinstance(e, RequestNotice)]
            assert len(notices) == 1 and "does not support n" in notices[0].message and "\n" not in notices[0].message
            assert [b.get("n") for b in fake.bodies] == [2, None]
            assert [b["seed"] for b in fake.bodies] == [5, 6]  # the left-out reply keeps its own seed
            h.submit_chats(HI, [(3, TWO[0][1]), (4, TWO[1][1])])  # later K replies: K requests at once
            evs = collect(h, finished([3, 4]), 15)
            assert sorted(s.request_id for s in (e.summary for e in evs if isinstance(e, RequestFinished))) == [3, 4]
            assert [b.get("n") for b in fake.bodies[2:]] == [None, None]
            assert not any(isinstance(e, RequestNotice) for e in evs)  # said once
        finally:
            h.shutdown()


def test_a_server_that_ignores_n_and_cuts_a_stream_when_another_comes_gets_replies_in_turn():
    """llama-cpp-python's server by default: one choice whatever `n` asks, and a new request cuts
    the stream still running. K = 3 replies, twice: all six arrive whole, one request at a time."""
    with FakeServer("llama_cpp", tokens=5) as fake:
        h = EndpointClient(fake.base)
        try:
            started(h)
            three = [(i, SamplingParams(max_tokens=50, temperature=0.8, seed=10 + i)) for i in (1, 2, 3)]
            h.submit_chats(HI, three)
            evs = collect(h, finished([1, 2, 3]), 20)
            h.submit_chats(HI, [(i + 3, p) for i, p in three])
            evs += collect(h, finished([4, 5, 6]), 20)
            assert not any(isinstance(e, EngineError) for e in evs), [e for e in evs if isinstance(e, EngineError)]
            ends = _ends(evs)
            assert {rid: [(s.finish_reason, s.output_tokens) for s in ss] for rid, ss in ends.items()} == {
                rid: [("length", 5)] for rid in range(1, 7)}
            assert [b.get("n") for b in fake.bodies] == [3] + [None] * 5
            assert [b["seed"] for b in fake.bodies] == [11, 12, 13, 11, 12, 13]
        finally:
            h.shutdown()
