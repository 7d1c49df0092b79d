"""Engine configuration (no torch import: the UI process builds it without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fgchat.protocol.events import Mode
from fgchat.protocol.tuning import Tuning


# sequences decoded together at most: the KV cache's slots, the graphs' batch sizes 1..MAX_BATCH
MAX_BATCH = 8


@dataclass
class EngineConfig:
    model: str | None = None  # repo id, directory, .gguf, or None for the embedded default
    preset: str | None = None  # random weights of a preset's shape instead of `model`
    device: str | None = None
    dtype: str | None = None
    max_context: int | None = None
    mode: Mode | None = None  # None: full where CUDA graphs work, else eager (no warning)
    attention: str = "auto"
    lazy_capture: bool = False
    self_check: bool = True
    seed: int = 0
    # with preset: massive activation channels of this size in the residual stream (0: none)
    outliers: float = 0.0
    quantize: str = "none"
    dequantize: bool = False
    # kernel-path switches; None: Tuning.from_env() (the FGCHAT_* variables) when the engine starts
    tuning: Tuning | None = None
    notes: list[str] = field(default_factory=list)
    speculate: str = "off"  # "off" | "ngram" | "draft" | "oracle"
    draft: str | None = None  # the draft model (speculate="draft")
    draft_len: int = 4
