"""config.json values of the families the plain stages serve beyond Llama / Qwen2 / Mistral
(Qwen3, Gemma 3 text, Phi-3 / Phi-4-mini): their raw forms normalised to the shared keys, and the
ModelConfig fields that only they set (model.families reads them)."""

from __future__ import annotations

import math
from typing import Any

from fgchat.protocol.errors import ModelLoadError

# the architectures whose decode runs model.families' stages (the fused ones too: families.fused_serves)
FAMILY_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
# Gemma 3 layer types before `layer_types` existed: every sliding_window_pattern-th layer is global
GEMMA_PATTERN = 6
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def normalize_raw(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """raw with Gemma 3's per-layer-type `rope_parameters` flattened to the global layers' values
    (rope_theta, rope_scaling; the local layers' theta kept as rope_local_base_freq) and Phi-3's
    legacy "su" / "yarn" RoPE type named "longrope" (transformers does the same)."""
    raw = dict(raw)
    rope = raw.get("rope_parameters")
    if arch == "Gemma3ForCausalLM" and isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        full, local = dict(rope["full_attention"]), rope.get("sliding_attention") or {}
        raw.pop("rope_parameters")
        raw.setdefault("rope_theta", full.pop("rope_theta", 1_000_000.0))
        if full.get("rope_type", full.get("type", "default")) != "default":
            raw["rope_scaling"] = full
        if isinstance(local, dict) and local.get("rope_theta") is not None:
            raw.setdefault("rope_local_base_freq", local["rope_theta"])
    if arch == "Phi3ForCausalLM":
        key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        sc = raw.get(key)
        if isinstance(sc, dict) and sc.get("rope_type", sc.get("type")) in ("su", "yarn", "longrope"):
            sc = {k: v for k, v in sc.items() if k != "type"}
            sc["rope_type"] = "longrope"
            sc.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
            if sc.get("partial_rotary_factor") is not None:
                raw.setdefault("partial_rotary_factor", sc["partial_rotary_factor"])
            if key == "rope_parameters" and sc.get("rope_theta") is not None:
                raw.setdefault("rope_theta", sc["rope_theta"])
            raw.pop("rope_parameters", None)
            raw["rope_scaling"] = sc
    if arch == "Gemma3ForCausalLM":
        raw.setdefault("rope_theta", 1_000_000.0)
    return raw


def check_longrope(scaling: dict[str, Any], rotary_dim: int, max_position: int) -> dict[str, Any]:
    """A LongRoPE scaling dict validated, with its cos / sin factor resolved as transformers does
    (attention_factor, else sqrt(1 + ln(factor) / ln(original)) for factor = max / original > 1)."""
    orig = scaling.get("original_max_position_embeddings")
    if isinstance(orig, bool) or not isinstance(orig, (int, float)) or orig < 1:
        raise ModelLoadError("invalid config.json: longrope needs original_max_position_embeddings >= 1")
    for name in ("short_factor", "long_factor"):
        f = scaling.get(name)
        if (not isinstance(f, list) or len(f) != rotary_dim // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f)):
            raise ModelLoadError(f"invalid config.json: rope_scaling.{name} must be {rotary_dim // 2} positive numbers")
    out = dict(scaling, original_max_position_embeddings=int(orig))
    att = scaling.get("attention_factor")
    if att is None:
        factor = scaling.get("factor") or max_position / orig
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    out["attention_factor"] = float(att)
    return out


def family_fields(arch: str, raw: dict[str, Any], head_dim: int, layers: int) -> dict[str, Any]:
    """The ModelConfig fields of `arch` beyond the shared ones ({} for Llama / Qwen2 / Mistral)."""
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch == "Phi3ForCausalLM":
        factor = raw.get("partial_rotary_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ModelLoadError(f"invalid config.json: partial_rotary_factor must be in (0, 1], got {factor!r}")
        rot = int(head_dim * factor)
        if rot < 2 or rot % 2:
            raise ModelLoadError(f"invalid config.json: partial_rotary_factor {factor} gives an odd rotary size {rot}")
        return {"rotary_dim": rot} if rot != head_dim else {}
    if arch != "Gemma3ForCausalLM":
        return {}
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("unsupported config.json: use_bidirectional_attention (fgchat decodes causally)")
    if raw.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("unsupported config.json: attn_logit_softcapping (no attention backend applies it)")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ModelLoadError(f"unsupported config.json: hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern") or GEMMA_PATTERN
        types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError("invalid config.json: layer_types must name sliding_attention or full_attention per layer")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"invalid config.json: sliding_window must be a positive integer, got {window!r}")
    scalar = raw.get("query_pre_attn_scalar", 256)
    local = raw.get("rope_local_base_freq", 10_000.0)
    cap = raw.get("final_logit_softcapping")
    for name, v in (("query_pre_attn_scalar", scalar), ("rope_local_base_freq", local), ("final_logit_softcapping", cap)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ModelLoadError(f"invalid config.json: {name} must be a positive number, got {v!r}")
    return {
        "qk_norm": True,
        "gemma_norms": True,
        "activation": "gelu_tanh",
        "attn_scale": float(scalar) ** -0.5,
        "layer_windows": tuple(window or 0 if t == "sliding_attention" else 0 for t in types),
        "local_rope_theta": float(local),
        "final_softcap": None if cap is None else float(cap),
    }
