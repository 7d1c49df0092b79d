"""Decoder configuration parsed from a Hugging Face config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fgchat.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None
    eos_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate and normalise a config.json dict; unsupported models raise ModelLoadError."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        got = ", ".join(archs) if archs else raw.get("model_type", "unknown")
        raise ModelLoadError(
            f"unsupported architecture {got}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear"):
                raise ModelLoadError(f"unsupported RoPE scaling '{kind}' (supported: llama3, linear)")
        theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            eos_ids=_as_ids(raw.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"invalid config.json: {type(exc).__name__}: {exc}") from None


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse frequencies for RoPE, with Llama-3 / linear scaling applied."""
    dim = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return [f / factor for f in inv]
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old_ctx / low, old_ctx / high
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wl - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
