"""Prometheus metrics of `fgchat serve` (vLLM-style names under the `fgchat:` prefix).

Invariants:
- Each server has its own CollectorRegistry (several servers in one process never share counts).
- Latencies are the engine's own (TokenEvent / RequestSummary), in seconds, labelled by the
  decode mode that produced them; TTFT (observed when a request finishes) is labelled by
  the mode the engine is in.
- Batch size is observed once per decode token (so it is weighted by tokens).
- Speculation (vLLM's spec_decode names) is counted once per speculated step, at its first token
  (a new step_id of its request), labelled by method: drafts (steps that proposed), draft tokens
  (proposed), accepted tokens, and the step's tokens (accepted + the target's own) in the
  tokens-per-step histogram. acceptance = accepted / draft tokens; tokens per step = its sum /
  its count.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fgchat.protocol.events import MODES, RequestSummary, TokenEvent

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
                0.03, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
BATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
SPEC_METHODS = ("ngram", "draft", "oracle")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("fgchat:time_to_first_token_seconds", "Time to first token (engine)",
                              ["mode"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fgchat:inter_token_latency_seconds", "Time between two tokens of a request",
                             ["mode"], buckets=ITL_BUCKETS, registry=r)
        self.gpu_step = Histogram("fgchat:gpu_step_time_seconds", "GPU time of a decode step (CUDA only)",
                                  ["mode"], buckets=STEP_BUCKETS, registry=r)
        self.launch = Histogram("fgchat:step_launch_time_seconds", "Host time to launch a decode step",
                                ["mode"], buckets=STEP_BUCKETS, registry=r)
        self.e2e = Histogram("fgchat:e2e_request_latency_seconds", "Submit to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.batch = Histogram("fgchat:batch_size", "Decode batch size, one observation per decode token",
                               buckets=BATCH_BUCKETS, registry=r)
        self.running = Gauge("fgchat:num_requests_running", "Requests generating", registry=r)
        self.waiting = Gauge("fgchat:num_requests_waiting", "Requests queued before their first token",
                             registry=r)
        self.mode = Gauge("fgchat:engine_mode", "1 for the engine's current decode mode", ["mode"], registry=r)
        self.finished = Counter("fgchat:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.rejected = Counter("fgchat:request_rejected", "Requests refused with 429 (queue full)", registry=r)
        self.prompt_tokens = Counter("fgchat:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("fgchat:generation_tokens", "Generated tokens", registry=r)
        self.spec_drafts = Counter("fgchat:spec_decode_num_drafts", "Speculated decode steps (per request)",
                                   ["method"], registry=r)
        self.spec_draft_tokens = Counter("fgchat:spec_decode_num_draft_tokens", "Drafted tokens proposed",
                                         ["method"], registry=r)
        self.spec_accepted = Counter("fgchat:spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                     ["method"], registry=r)
        self.spec_tokens_per_step = Histogram(
            "fgchat:spec_decode_tokens_per_step", "Tokens a speculated step emitted (accepted + 1)",
            ["method"], buckets=TOKENS_PER_STEP_BUCKETS, registry=r)
        self._step_of: dict[int, int] = {}  # request id -> its latest speculated step seen
        for method in SPEC_METHODS:
            for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.spec_tokens_per_step):
                c.labels(method)
        for m in MODES:  # every label exists from the start: a scrape sees zeros, not gaps
            for h in (self.ttft, self.itl, self.gpu_step, self.launch):
                h.labels(m)
            self.mode.labels(m).set(0)

    def token(self, ev: TokenEvent) -> None:
        self.generation_tokens.inc()
        if ev.is_first_token:
            return
        self.batch.observe(ev.batch_size)
        if ev.itl_ms is not None:
            self.itl.labels(ev.mode).observe(ev.itl_ms / 1e3)
        if ev.gpu_step_ms is not None:
            self.gpu_step.labels(ev.mode).observe(ev.gpu_step_ms / 1e3)
        if ev.launch_ms is not None:
            self.launch.labels(ev.mode).observe(ev.launch_ms / 1e3)
        if ev.spec_method and ev.step_id >= 0 and self._step_of.get(ev.request_id) != ev.step_id:
            self._step_of[ev.request_id] = ev.step_id
            method = ev.spec_method
            self.spec_drafts.labels(method).inc()
            self.spec_draft_tokens.labels(method).inc(ev.draft_len)
            self.spec_accepted.labels(method).inc(ev.accepted_in_step)
            self.spec_tokens_per_step.labels(method).observe(ev.accepted_in_step + 1)

    def request(self, s: RequestSummary, engine_mode: str) -> None:
        """A finished request; its TTFT (engine-measured, submit to first token) is labelled by
        the mode the engine is in."""
        self.finished.labels(s.finish_reason).inc()
        self._step_of.pop(s.request_id, None)
        if s.output_tokens:
            self.ttft.labels(engine_mode).observe(s.ttft_ms / 1e3)
        self.prompt_tokens.inc(s.prompt_tokens)
        self.e2e.observe(s.e2e_ms / 1e3)

    def set_mode(self, mode: str) -> None:
        for m in MODES:
            self.mode.labels(m).set(1 if m == mode else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
