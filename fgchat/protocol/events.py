"""Typed messages the engine emits. Plain dataclasses: they cross process boundaries by pickle."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal


class Mode(StrEnum):
    """How the engine launches a decode step. A str: compares, prints and serializes as its value."""

    EAGER = "eager"  # every kernel launched from the host
    PIECEWISE = "piecewise"  # graphs between attention calls, attention launched from the host
    FULL = "full"  # one graph per batch size for the whole step
    MEGA = "mega"  # every decoder layer as one persistent kernel, in one graph per batch size


MODES: tuple[Mode, ...] = tuple(Mode)
# the mode label of tokens whose server did not say how it ran them (an OpenAI-compatible server
# that is not fgchat); not a Mode: nothing can switch to it
REMOTE_MODE = "remote"
MAX_TOP_K = 2**31 - 1  # larger top-k values mean "every token" (no vocabulary is that large)
SEED_SPACE = 2**63  # seeds are in [0, SEED_SPACE); seed + j of K samples wraps around in it


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy; top_k <= 0 and top_p >= 1 disable them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 256
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # transformers' rule over prompt and output tokens: a seen token's logit is divided by it when
    # positive, multiplied when negative; 1 disables it
    repetition_penalty: float = 1.0
    # OpenAI's rules over output tokens: logit -= presence * [count > 0] + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # speculate="oracle" only: the drafts this request's steps propose (the target's own greedy
    # continuation from an earlier run); None elsewhere
    oracle_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        # a top-k past any vocabulary keeps every token: the same as off, and it must fit int64
        if isinstance(self.top_k, int) and self.top_k > MAX_TOP_K:
            object.__setattr__(self, "top_k", 0)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_generation_config(cls, gc: dict[str, Any], **overrides: Any) -> SamplingParams:
        """Defaults from a model's generation_config.json (transformers' keys). `do_sample` false
        (or absent, as transformers reads it) means greedy whatever temperature says."""
        kw: dict[str, Any] = {}
        if gc.get("do_sample"):
            for key in ("temperature", "top_p"):
                if isinstance(gc.get(key), (int, float)) and not isinstance(gc.get(key), bool):
                    kw[key] = float(gc[key])
            if isinstance(gc.get("top_k"), int) and not isinstance(gc.get("top_k"), bool):
                kw["top_k"] = max(0, gc["top_k"])
        rp = gc.get("repetition_penalty")
        if isinstance(rp, (int, float)) and not isinstance(rp, bool) and rp > 0:
            kw["repetition_penalty"] = float(rp)
        kw.update(overrides)
        return cls(**kw)

    def validate(self) -> None:
        from fgchat.protocol.errors import RequestError

        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise RequestError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise RequestError(f"max tokens must be >= 1, got {self.max_tokens}")
        if not (0 <= self.seed < SEED_SPACE):
            raise RequestError(f"seed must be in [0, 2^63), got {self.seed}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise RequestError(f"repetition penalty must be in (0, 10], got {self.repetition_penalty}")
        for name, v in (("presence", self.presence_penalty), ("frequency", self.frequency_penalty)):
            if not (-2.0 <= v <= 2.0):
                raise RequestError(f"{name} penalty must be in [-2, 2], got {v}")


@dataclass
class TokenEvent:
    """One emitted token and the timing of the step that produced it."""

    request_id: int
    token_index: int  # 0 for the first generated token
    token_id: int
    text: str  # text delta (may be "" while a multi-byte character is incomplete)
    mode: Mode | str  # mode that ran the step ("eager" for prefill; REMOTE_MODE when unknown)
    batch_size: int  # sequences in the step that produced this token
    t_ns: int  # host monotonic time when the token was available
    itl_ms: float | None  # since this request's previous token; None for the first
    gpu_step_ms: float | None  # GPU time of the step (CUDA events); None on CPU
    is_first_token: bool
    position: int  # position of this token in the sequence (prompt_tokens + token_index)
    graph: str | None = None  # which graph ran, e.g. "full/b4"; None when eager
    # host time to enqueue the step (its kernels, or its graphs and eager attention calls);
    # a step is host-bound when this reaches gpu_step_ms. None for prefill's first token
    launch_ms: float | None = None
    # speculative decoding: the request's decode step that produced the token (from 0; -1 for
    # prefill's token), whether it was a draft the target accepted, the drafts proposed and
    # accepted in that step (0 when speculation is off) and the method ("" when off)
    step_id: int = -1
    drafted: bool = False
    draft_len: int = 0
    accepted_in_step: int = 0
    spec_method: str = ""


@dataclass
class RequestSummary:
    request_id: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float | None  # mean over tokens after the first; None with a single token
    e2e_ms: float
    finish_reason: Literal["stop", "length", "cancelled", "error"]
    text: str
    token_ids: list[int] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    mode_counts: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens whose K/V rows a slot still held: not prefilled again
    # speculative decoding: {"method", "draft_len", "proposed", "accepted", "acceptance_rate",
    # "tokens_per_step", "paused_for_cost" (decode steps run plainly because speculation cost more
    # per token than plain decoding at the batch size)}; None when off
    spec: dict | None = None


@dataclass
class RequestFinished:
    summary: RequestSummary


@dataclass
class ModeChanged:
    mode: Mode | str  # REMOTE_MODE: a server that does not say how it runs
    reason: str = ""


@dataclass
class CaptureReport:
    """Graph capture cost for one (mode, batch size), or for one prefill token bucket
    (kind "prefill": batch_size holds the bucket's token count)."""

    mode: Mode
    batch_size: int
    seconds: float
    pool_mib: float
    kind: str = "decode"


@dataclass
class StartupCheck:
    """The start-up check of the production path against a float32 plain-torch reference, on
    the loaded weights (engine.startup_check). `path` names what was checked; when it disagreed,
    `fallback` names what runs instead and `message` is the one line shown to the user."""

    passed: bool
    path: str
    top1_equal: bool
    top5_overlap: int
    max_rel_err: float
    seconds: float
    fallback: str | None = None
    message: str = ""


@dataclass
class EngineInfo:
    model_name: str
    architecture: str
    device: str
    dtype: str
    max_context: int
    num_layers: int
    attention_backend: str
    available_modes: dict[str, str]  # mode -> "" if available else the reason it is not
    mode: Mode | str  # REMOTE_MODE: a server that does not say how it runs
    captures: list[CaptureReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # seconds of the eager warm-up step per batch size before capture (Triton JIT on a cold cache)
    kernel_warmup_s: float | None = None
    startup_check: StartupCheck | None = None
    startup_check_pending: bool = False  # deferred until idle; a later EngineInfo brings the result
    # the model's own sampling defaults (generation_config.json); greedy SamplingParams() when it
    # has none. Entry points start from these and apply the user's overrides
    sampling_defaults: SamplingParams = field(default_factory=SamplingParams)
    sampling_source: str = ""  # where sampling_defaults came from ("" = built-in greedy)
    # non-empty when the "engine" is a remote OpenAI-compatible server at this URL: timings are
    # then measured at the client, and gpu_step_ms / launch_ms are None unless it is fgchat
    endpoint: str = ""
    # CPU: how decode steps run ("eager"); "" on CUDA and for endpoints
    cpu_step: str = ""
    # the weights as held on the device (engine.quant.describe): their format ("bf16", "Q4_1",
    # "Q4_K+Q6_K", "int4"), the bytes they occupy and the bytes a batch-1 decode step reads (every
    # layer and the LM head; the same at any batch size up to 8). "" / 0 for endpoints
    weights: str = ""
    weight_bytes: int = 0
    step_bytes: int = 0
    # the GPU's peak memory bandwidth in bytes per second (engine.bandwidth); None on CPU, for
    # endpoints and for GPUs of unknown bandwidth
    peak_bandwidth: float | None = None
    # speculative decoding: the method ("off" | "ngram" | "draft" | "oracle"), the drafts proposed
    # per step at most, and the draft model's name (method "draft")
    speculate: str = "off"
    draft_len: int = 0
    draft_model: str = ""


@dataclass
class EngineProgress:
    """What a starting engine is doing (sent before EngineInfo), e.g. a first-start conversion."""

    phase: str


@dataclass
class RequestNotice:
    """Something the engine changed about a request on its way in, not an error (one line): e.g.
    the oldest turns of a chat left out of a prompt that no longer fit the context."""

    request_id: int
    message: str
    title: str = "context full"  # what the UI heads the notice with


@dataclass
class EngineError:
    """A failure inside the engine; message is one line. fatal means the engine stopped. refused
    means the request was turned away as submitted (its prompt or messages: the sender's to fix);
    otherwise the engine failed it."""

    message: str
    request_id: int | None = None
    fatal: bool = False
    refused: bool = False


EngineEvent = (TokenEvent | RequestFinished | ModeChanged | EngineError | EngineInfo | EngineProgress
               | RequestNotice)
