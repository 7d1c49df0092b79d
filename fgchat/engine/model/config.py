"""Decoder configuration parsed from a Hugging Face config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fgchat.protocol.errors import ModelLoadError

from fgchat.engine.model.arch_config import FAMILY_ARCHITECTURES, check_longrope, family_fields, normalize_raw

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", *FAMILY_ARCHITECTURES)


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
    sliding_window: int | None = None  # every layer's window (Mistral): the context is capped to it
    eos_ids: tuple[int, ...] = field(default_factory=tuple)
    # the families of model.families (arch_config.family_fields); the defaults are Llama's
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    gemma_norms: bool = False  # RMSNorm by (1 + w) in float32, norms after attention and MLP, embed x sqrt(H)
    activation: str = "silu"  # of the gate: silu or gelu_tanh
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head; None: all of it
    layer_windows: tuple[int, ...] = ()  # per layer: attend to the last n positions (0: all)
    local_rope_theta: float | None = None  # RoPE base of the windowed layers (their own, unscaled)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

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


class _Invalid(ValueError):
    """A config.json value out of range; the message names the field."""


def _int_field(raw: dict[str, Any], key: str, default: Any = None, *, minimum: int = 1) -> int:
    """An integer config value >= minimum (an integral float such as 64.0 is accepted)."""
    value = raw.get(key, default)
    if value is None:
        raise _Invalid(f"{key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise _Invalid(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise _Invalid(f"{key} must be >= {minimum}, got {value!r}")
    return int(value)


def _float_field(raw: dict[str, Any], key: str, default: float, *, positive: bool = True,
                 name: str | None = None) -> float:
    """A finite number > 0 (positive) or >= 0."""
    name = name or key
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Invalid(f"{name} must be a finite number, got {value!r}")
    if (value <= 0) if positive else (value < 0):
        raise _Invalid(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _check_scaling(scaling: dict[str, Any], kind: str, where: str) -> None:
    """RoPE scaling values that rope_inv_freq divides by (a zero factor, or low_freq_factor ==
    high_freq_factor for llama3, would divide by zero or give inf/nan frequencies)."""
    _float_field(scaling, "factor", 1.0, name=f"{where}.factor")
    if kind == "llama3":
        low = _float_field(scaling, "low_freq_factor", 1.0, name=f"{where}.low_freq_factor")
        high = _float_field(scaling, "high_freq_factor", 4.0, name=f"{where}.high_freq_factor")
        if high <= low:
            raise _Invalid(f"{where}.high_freq_factor ({high:g}) must be greater than "
                           f"{where}.low_freq_factor ({low:g})")
        _float_field(scaling, "original_max_position_embeddings", 8192,
                     name=f"{where}.original_max_position_embeddings")


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate and normalise a config.json dict; unsupported models and values out of range (sizes
    that are not positive integers, heads that do not divide, RoPE values that divide by zero) raise
    ModelLoadError with one line naming the field."""
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ModelLoadError(f"invalid config.json: architectures must be a list, got {archs!r}")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        got = ", ".join(map(str, archs)) if archs else raw.get("model_type", "unknown")
        raise ModelLoadError(
            f"unsupported architecture {got}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    raw = normalize_raw(arch, raw)
    try:
        hidden = _int_field(raw, "hidden_size")
        heads = _int_field(raw, "num_attention_heads")
        kv_heads = _int_field(raw, "num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
        if heads % kv_heads:
            raise _Invalid(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        if raw.get("head_dim") is not None:
            head_dim = _int_field(raw, "head_dim")
        elif hidden % heads:
            raise _Invalid(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads}) "
                           "when head_dim is not given")
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            raise _Invalid(f"head_dim must be even for rotary embeddings, got {head_dim}")
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise _Invalid(f"rope_parameters must be an object, got {rope!r}")
        rope = dict(rope)
        scaling = raw.get("rope_scaling") or None
        where = "rope_scaling"
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            where = "rope_parameters"
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise _Invalid(f"{where} must be an object, got {scaling!r}")
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind == "longrope" and arch == "Phi3ForCausalLM":
                factor = raw.get("partial_rotary_factor", 1.0)
                rot = int(head_dim * factor) if isinstance(factor, (int, float)) else head_dim
                scaling = check_longrope(scaling, rot, _int_field(raw, "max_position_embeddings", 4096))
            elif kind not in ("llama3", "linear"):
                raise ModelLoadError(f"unsupported RoPE scaling '{kind}' (supported: llama3, linear"
                                     f"{', longrope (Phi-3)' if arch == 'Phi3ForCausalLM' else ''})")
            else:
                _check_scaling(scaling, kind, where)
        if raw.get("rope_theta") is not None:
            theta = _float_field(raw, "rope_theta", 10000.0)
        else:
            theta = _float_field(rope, "rope_theta", 10000.0, name="rope_parameters.rope_theta")
        extra = family_fields(arch, raw, head_dim, _int_field(raw, "num_hidden_layers"))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        if extra.get("layer_windows"):  # windows of some layers only: the context is not capped
            sliding = None
        if sliding is not None and sliding is not False:
            sliding = _int_field(raw, "sliding_window", minimum=0) or None
        return ModelConfig(
            architecture=arch,
            vocab_size=_int_field(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int_field(raw, "intermediate_size"),
            num_layers=_int_field(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_eps=_float_field(raw, "rms_norm_eps", 1e-6, positive=False),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=_int_field(raw, "max_position_embeddings", 4096),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            sliding_window=sliding or None,
            eos_ids=_as_ids(raw.get("eos_token_id")),
            **extra,
        )
    except _Invalid as exc:
        raise ModelLoadError(f"invalid config.json: {exc}") from None
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
