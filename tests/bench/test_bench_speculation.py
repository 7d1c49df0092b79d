"""`fgchat bench --speculate`: rows "full+ngram", "full+oracle" beside the plain ones, with
acceptance and tokens per step, and tokens/s over the plain row's; the oracle's drafts are the
prompts' own greedy continuation from a plain run first. A scripted engine stands in for the
real one (its speculation is issue 55's engine side)."""

from __future__ import annotations

import argparse
import io
from types import SimpleNamespace

from fgchat.bench.cli import speculation_args
from fgchat.bench.report import print_report, summary_rows
from fgchat.bench.runner import measure_engine, spec_figures
from fgchat.bench.spec import BenchSpec
from fgchat.protocol.events import RequestFinished, RequestSummary, TokenEvent

K = 4
ACCEPTED = [2, 4, 0, 3, 1]


def spec_steps(rid: int, method: str, accepted: list[int]) -> list[TokenEvent]:
    out = [TokenEvent(rid, 0, 7, "", "eager", 1, 0, None, None, True, 8)]
    for step, acc in enumerate(accepted):
        for j in range(acc + 1):
            i = len(out)
            out.append(TokenEvent(rid, i, 7 + i, "", "full", 1, i, 1.0 if j == 0 else 0.01, 0.9, False, 8 + i,
                                  step_id=step, drafted=j < acc, draft_len=K if method else 0,
                                  accepted_in_step=acc, spec_method=method))
    return out


def test_spec_figures_of_token_events():
    f = spec_figures(spec_steps(1, "ngram", ACCEPTED) + spec_steps(2, "ngram", [4]))
    steps, acc = len(ACCEPTED) + 1, sum(ACCEPTED) + 4
    assert f == {"acceptance_rate": acc / (K * steps), "tokens_per_step": (acc + steps) / steps, "spec_steps": steps}
    assert spec_figures(spec_steps(1, "", [0, 0]))["acceptance_rate"] is None  # plain steps: none


class ScriptedEngine:
    """Engine's bench surface: oracle accepts every draft; ngram the ACCEPTED script."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(vocab_size=100)
        self.method = "off"
        self.calls: list[tuple] = []
        self.pending: list[tuple[int, object]] = []
        self.oracles: list = []
        self.captures: list = []  # ngram's rounds each capture a graph (a shape the warm-up missed)

    def info(self):
        return SimpleNamespace(captures=list(self.captures))

    def set_mode(self, mode): pass
    def capture_sizes(self, mode, sizes): pass
    def capture_idle(self): return False

    def set_speculation(self, method, draft_len=None):
        self.calls.append((method, draft_len))
        self.method = method

    def submit(self, prompt, params):
        rid = len(self.oracles) + len(self.pending) + 1000 * len(self.calls)
        self.pending.append((rid, params))
        return rid

    def run_until_done(self):
        out = []
        for rid, params in self.pending:
            self.oracles.append(params.oracle_tokens)
            accepted = {"off": [0] * 6, "ngram": ACCEPTED, "oracle": [K] * 3}[self.method]
            self.captures += ["verify"] if self.method == "ngram" else []
            toks = spec_steps(rid, "" if self.method == "off" else self.method, accepted)
            out += toks
            out.append(RequestFinished(RequestSummary(rid, 8, len(toks), 1.0, 1.0, 9.0, "length", "",
                                                      token_ids=[t.token_id for t in toks])))
        self.pending = []
        return out


def test_rows_and_the_oracle_drafts():
    engine = ScriptedEngine()
    spec = BenchSpec(output_len=16, prompt_len=8, warmup=0, repeats=1, draft_len=K)
    runs = [measure_engine(engine, "full", 1, spec, m) for m in ("off", "ngram", "oracle")]
    assert [r["runner"] for r in runs] == ["fgchat-full", "fgchat-full+ngram", "fgchat-full+oracle"]
    assert engine.calls == [("ngram", K), ("off", None), ("oracle", K), ("off", None)]
    # the oracle's drafts: the greedy run's tokens (submitted plain, before speculation was on),
    # then the oracle round's own, which the next round reproduces
    greedy = [t.token_id for t in spec_steps(0, "", [0] * 6)]
    settled = [t.token_id for t in spec_steps(0, "oracle", [K] * 3)]
    assert engine.oracles[-4:] == [None, greedy, settled, settled] and engine.oracles[0] is None
    assert runs[2]["oracle"]["rounds"] == 2 and runs[2]["oracle"]["reproduced"]
    assert runs[2]["oracle"]["first_token_unlike_plain"] == [len(greedy)]  # the same tokens, longer
    assert [r["captures_timed"] for r in runs] == [0, 1, 0]
    assert runs[0]["acceptance_rate"] is None
    assert runs[1]["acceptance_rate"] == sum(ACCEPTED) / (K * len(ACCEPTED)) and runs[2]["acceptance_rate"] == 1.0
    assert runs[2]["tokens_per_step"] == K + 1
    for r in runs:
        r.update(output_tokens_per_s={"off": 100.0, "ngram": 150.0, "oracle": 400.0}[r["speculate"]])
    rows = {r["runner"]: r for r in summary_rows({"runs": runs})}
    assert rows["fgchat-full+oracle"]["speedup_vs_plain"] == 4.0 and rows["fgchat-full"]["speedup_vs_plain"] is None
    out = io.StringIO()
    result = {"meta": {"model": "m", "device": "d", "dtype": "bf16", "attention": "a", "prompt_len": 8,
                       "output_len": 16, "commit": "c"}, "runs": runs, "captures": [], "skipped": []}
    print_report(result, out)
    text = out.getvalue()
    print(text)
    assert "accept %" in text and "tok/step" in text and "× plain" in text and "4.00x" in text
    assert "Acceptance rate (%):" in text and "Speculation (ngram)" in text


def test_speculate_list_from_the_flags():
    assert speculation_args(argparse.Namespace(speculate="off,ngram,oracle", draft=None, draft_len=6)) == {
        "speculate": ["off", "ngram", "oracle"], "draft": None, "draft_len": 6}
    assert speculation_args(argparse.Namespace())["speculate"] == ["off"]


def test_the_oracle_settles_on_the_verification_steps_own_greedy_tokens():
    """A verification step that rounds some near-tied argmaxes apart from plain steps (a stand-in:
    after every text whose ids sum to a multiple of 5 it picks the next id) makes the plain run's
    tokens stop holding as drafts at the first such text. The bench's oracle settles its drafts on
    the verification's own greedy run, so the timed round accepts every draft and emits the
    drafts; the plain run is said to differ."""
    from fgchat.engine.core import Engine, EngineConfig

    eng = Engine(EngineConfig(preset="tiny", device="cpu", seed=3, dtype="float32", max_context=96))
    vocab, verify = eng.cfg.vocab_size, eng._verify

    def rounding_apart(seqs, drafts):
        best, logits, ran, block = verify(seqs, drafts)
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            for j in range(len(d) + 1):
                if sum(s.prompt_ids + s.output_ids + d[:j]) % 5 == 0:
                    best[i * block + j] = (best[i * block + j] + 1) % vocab
        return best, logits, ran, block

    eng._verify = rounding_apart
    spec = BenchSpec(output_len=40, prompt_len=12, warmup=1, repeats=1, draft_len=K)
    run = measure_engine(eng, "eager", 2, spec, "oracle")
    oracle = run["oracle"]
    print(oracle, run["acceptance_rate"], run["tokens_per_step"])
    assert oracle["reproduced"] and oracle["rounds"] >= 2
    assert all(i is not None and i < 40 for i in oracle["first_token_unlike_plain"])
    assert run["acceptance_rate"] == 1.0 and run["tokens_per_step"] > K  # K + 1 a step, the last shorter
    assert run["output_tokens"] == [40, 40] and run["captures_timed"] == 0
