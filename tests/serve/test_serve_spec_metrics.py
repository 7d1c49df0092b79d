"""/metrics exports speculation: drafts, draft tokens and accepted tokens per method, and the
tokens each speculated step emitted (tokens per step = its sum / its count), counted once per
step whatever the number of its tokens; serve passes --speculate/--draft/--draft-len to the
engine's config."""

from __future__ import annotations

import argparse

from prometheus_client.parser import text_string_to_metric_families

from fgchat.protocol.config import EngineConfig
from fgchat.protocol.events import RequestSummary, TokenEvent
from fgchat.serve.metrics import ServeMetrics
from fgchat.serve.run import speculation_config

ACCEPTED = {1: [3, 0, 2], 2: [4, 4]}  # request -> drafts accepted per step
K = 4


def _samples(metrics: ServeMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, s.labels.get("method", ""))] = s.value
    return out


def test_speculation_counters():
    m = ServeMetrics()
    zero = _samples(m)
    assert zero[("fgchat:spec_decode_num_draft_tokens_total", "ngram")] == 0.0  # present before any step
    for rid, steps in ACCEPTED.items():
        m.token(TokenEvent(rid, 0, 1, "a", "eager", 2, 0, None, None, True, 5))
        i = 1
        for step, acc in enumerate(steps):
            for j in range(acc + 1):  # interleaved requests would not change the counts either
                m.token(TokenEvent(rid, i, 1, "b", "full", 2, i, 1.0, None, False, 5 + i, step_id=step,
                                   drafted=j < acc, draft_len=K, accepted_in_step=acc, spec_method="ngram"))
                i += 1
        m.request(RequestSummary(rid, 5, i, 1.0, 1.0, 9.0, "length", ""), "full")
    got = _samples(m)
    steps = sum(len(s) for s in ACCEPTED.values())
    accepted = sum(sum(s) for s in ACCEPTED.values())
    assert got[("fgchat:spec_decode_num_drafts_total", "ngram")] == steps
    assert got[("fgchat:spec_decode_num_draft_tokens_total", "ngram")] == K * steps
    assert got[("fgchat:spec_decode_num_accepted_tokens_total", "ngram")] == accepted
    assert got[("fgchat:spec_decode_tokens_per_step_count", "ngram")] == steps
    assert got[("fgchat:spec_decode_tokens_per_step_sum", "ngram")] == accepted + steps
    assert got[("fgchat:spec_decode_num_drafts_total", "draft")] == 0.0
    print(f"acceptance {accepted / (K * steps):.3f}, tokens/step {(accepted + steps) / steps:.3f}")


def test_serve_passes_the_speculation_options():
    config = EngineConfig(model="m")
    args = argparse.Namespace(speculate="ngram", draft=None, draft_len=6)
    got = speculation_config(args, config)
    assert (got.speculate, got.draft, got.draft_len, got.model) == ("ngram", None, 6, "m")
    assert speculation_config(argparse.Namespace(), config) is config  # flags not there: unchanged
