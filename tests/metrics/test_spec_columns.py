"""Speculation in the latency CSVs: token rows carry step id, drafted, draft length, accepted in
step and method (new columns at the end; files without them still read); request rows the spec
summary. The speculation window's figures against the same script summed here."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np

from fgchat.metrics import LatencyLog, read_requests_csv, read_tokens_csv, write_requests_csv, write_tokens_csv
from fgchat.metrics.spec_window import SpecWindow
from fgchat.protocol.events import RequestSummary, TokenEvent

ACCEPTED = [2, 0, 4, 1]
K = 4


def spec_tokens(rid: int, method: str = "ngram") -> list[TokenEvent]:
    out = [TokenEvent(rid, 0, 1, "a", "eager", 1, 1_000_000, None, None, True, 5)]
    i = 1
    for step, acc in enumerate(ACCEPTED):
        for j in range(acc + 1):
            out.append(TokenEvent(rid, i, 1, "b", "full", 1, 1_000_000 * (i + 1), 6.0 if j == 0 else 0.1, 5.5,
                                  False, 5 + i, step_id=step, drafted=j < acc, draft_len=K,
                                  accepted_in_step=acc, spec_method=method))
            i += 1
    return out


def test_token_and_request_rows_round_trip_the_speculation(tmp_path: Path):
    log = LatencyLog(start_ns=0)
    for ev in spec_tokens(1):
        log.add_token(ev, "c")
    spec = {"method": "ngram", "draft_len": K, "proposed": K * len(ACCEPTED), "accepted": sum(ACCEPTED),
            "acceptance_rate": sum(ACCEPTED) / (K * len(ACCEPTED)), "tokens_per_step": 2.75}
    log.add_request(RequestSummary(1, 5, 12, 1.0, 2.0, 30.0, "length", "", spec=spec), "c")
    log.add_request(RequestSummary(2, 5, 3, 1.0, 2.0, 5.0, "length", ""), "c")  # speculation off
    tokens_csv, requests_csv = tmp_path / "t.csv", tmp_path / "r.csv"
    write_tokens_csv(tokens_csv, log.tokens(), session_id="s")
    write_requests_csv(requests_csv, log.requests(), session_id="s")
    with open(tokens_csv, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[-5:] == ["step_id", "drafted", "draft_len", "accepted_in_step", "spec_method"]
    assert [r["step_id"] for r in rows] == ["-1"] + [str(s) for s, a in enumerate(ACCEPTED) for _ in range(a + 1)]
    assert [r["drafted"] for r in rows].count("1") == sum(ACCEPTED)
    assert read_tokens_csv(tokens_csv) == log.tokens()
    back = read_requests_csv(requests_csv)
    rates = [r.spec_acceptance_rate for r in log.requests()]
    assert [dataclasses.replace(r, spec_acceptance_rate=x) for r, x in zip(back, rates)] == log.requests()
    assert (back[0].spec_method, back[0].spec_proposed, back[0].spec_accepted) == ("ngram", 16, 7)
    assert abs(back[0].spec_acceptance_rate - 7 / 16) < 1e-3 and back[0].spec_tokens_per_step == 2.75
    assert back[1].spec_method == "" and back[1].spec_proposed is None
    # a file from before the columns: the defaults
    old = tmp_path / "old.csv"
    lines = tokens_csv.read_text().splitlines()
    old.write_text("\n".join(line.rsplit(",", 5)[0] for line in lines) + "\n")
    assert {(r.step_id, r.drafted, r.draft_len, r.spec_method) for r in read_tokens_csv(old)} == {(-1, False, 0, "")}


def test_spec_window_figures_and_its_limit():
    log = LatencyLog(start_ns=0)
    window = SpecWindow(log, limit=3)
    assert window.figures() is None
    for ev in spec_tokens(1):
        log.add_token(ev, "c")
    log.add_token(TokenEvent(2, 1, 1, "x", "full", 1, 0, 5.0, None, False, 9, step_id=0), "c")  # plain: out
    f = window.figures()
    kept = ACCEPTED[-3:]
    assert (f.steps, f.proposed, f.accepted, f.tokens) == (3, 3 * K, sum(kept), sum(kept) + 3)
    assert abs(f.acceptance_rate - sum(kept) / (3 * K)) < 1e-12
    assert f.tokens_per_step == (sum(kept) + 3) / 3
    np.testing.assert_allclose(f.step_ms, [6.0 + 0.1 * a for a in kept])
    assert f.token_itl_ms.size == f.tokens and (f.method, f.draft_len) == ("ngram", K)
