"""Per-request state held by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from fgchat.protocol.events import SamplingParams


@dataclass
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    submit_ns: int
    slot: int = -1
    cached_tokens: int = 0  # prompt rows already in the slot at admission (engine.prefix_reuse)
    output_ids: list[int] = field(default_factory=list)
    token_times_ns: list[int] = field(default_factory=list)
    itls_ms: list[float] = field(default_factory=list)
    mode_counts: dict[str, int] = field(default_factory=dict)
    text_parts: list[str] = field(default_factory=list)
    detok: object | None = None
    decode_steps: int = 0  # decode steps that emitted tokens for this request (TokenEvent.step_id)
    spec: object | None = None  # speculate.adaptive.AdaptiveK while speculation serves it

    @property
    def length(self) -> int:
        """Tokens in the cache once the last output token is fed: prompt + outputs - 1 pending."""
        return len(self.prompt_ids) + len(self.output_ids)
