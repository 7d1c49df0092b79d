"""What Qwen3, Gemma 3 and Phi-3 add to the Llama decoder, as plain torch ops shared by their
decode stages (model.family_stages), their prefill and the float32 reference
(model.family_reference): the extra weights and their checkpoint names, the norms, the gate's
activation, partial RoPE and the RoPE tables (per layer kind; LongRoPE per position)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fgchat.engine.model.arch_config import FAMILY_ARCHITECTURES
from fgchat.engine.model.config import ModelConfig, rope_inv_freq
from fgchat.engine.model.ops import apply_rope_rolled, rms_norm
from fgchat.protocol.errors import ModelLoadError

FAMILY_NAMES = {"Qwen3ForCausalLM": "Qwen3", "Gemma3ForCausalLM": "Gemma3", "Phi3ForCausalLM": "Phi3"}


def uses_family_stages(cfg: ModelConfig, fused: bool = False) -> bool:
    """The decoder runs model.family_stages (plain torch ops in every mode): every family
    architecture on the plain path (and the float32 reference, model.family_reference), and on the
    fused path those whose ops the fused kernels lack (a final logit softcap; see fused_serves)."""
    if cfg.architecture not in FAMILY_ARCHITECTURES:
        return False
    return not (fused and fused_serves(cfg))


def fused_serves(cfg: ModelConfig) -> bool:
    """The fused stages run every op of cfg's family model: Llama's with the per-head q/k norm
    before RoPE (Qwen3; kernels.fused.rope_kv_write applies it), Gemma 3's beside it: (1 + w)
    norms, also after attention and after the MLP (kernels.fused.add_rms_norm), the GELU(tanh)
    gate, the embedding scale, windowed layers with their own RoPE base, query_pre_attn_scalar
    (model.fused_step), and Phi-3's partial RoPE (rope_kv_write rotates the first rotary_dim dims
    of each head) and LongRoPE (rope_tables' per-position rows; a prefill past the original
    context reads prefill_table's long rows). Not a final logit softcap."""
    if cfg.architecture not in FAMILY_ARCHITECTURES or cfg.final_softcap is not None:
        return False
    if cfg.gemma_norms:
        return cfg.qk_norm and cfg.activation == "gelu_tanh"
    return cfg.activation == "silu" and not any(cfg.layer_windows) and cfg.attn_scale is None


def fused_note(cfg: ModelConfig) -> str | None:
    """The engine's line where the fused kernels do not serve cfg's architecture, else None."""
    if not uses_family_stages(cfg, fused=True):
        return None
    return f"fused kernels: not for {FAMILY_NAMES[cfg.architecture]}; plain torch stages"


@dataclass
class FamilyLayerWeights:
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]
    post_attn_norm: torch.Tensor | None = None  # [H] Gemma: on the o projection's output
    post_mlp_norm: torch.Tensor | None = None  # [H] Gemma: on the down projection's output


def normalize_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
    """Rename cfg's checkpoint tensors in place to the Llama names the loader takes: Phi-3's fused
    qkv_proj / gate_up_proj split into q, k, v and gate, up (rows in that order); Gemma 3's
    pre_feedforward_layernorm becomes post_attention_layernorm (the norm before the MLP), its own
    post_attention_layernorm moves to post_attn_norm (taken by take_family_weights)."""
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.architecture == "Phi3ForCausalLM" and p + "self_attn.qkv_proj.weight" in sd:
            qkv = sd.pop(p + "self_attn.qkv_proj.weight")
            if qkv.shape[0] != cfg.q_size + 2 * cfg.kv_size:
                raise ModelLoadError(f"layer {i}: qkv_proj shape does not match config.json")
            for n, t in zip("qkv", qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                sd[p + f"self_attn.{n}_proj.weight"] = t
        if cfg.architecture == "Phi3ForCausalLM" and p + "mlp.gate_up_proj.weight" in sd:
            gu = sd.pop(p + "mlp.gate_up_proj.weight")
            if gu.shape[0] != 2 * cfg.intermediate_size:
                raise ModelLoadError(f"layer {i}: gate_up_proj shape does not match config.json")
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gu.chunk(2, dim=0)
        if cfg.gemma_norms and p + "pre_feedforward_layernorm.weight" in sd:
            sd[p + "post_attn_norm.weight"] = sd.pop(p + "post_attention_layernorm.weight")
            sd[p + "post_attention_layernorm.weight"] = sd.pop(p + "pre_feedforward_layernorm.weight")


def take_family_weights(cfg: ModelConfig, sd: dict[str, torch.Tensor],
                        put: Callable[[torch.Tensor], torch.Tensor]) -> list[FamilyLayerWeights] | None:
    """Each layer's extra weights popped from sd (after normalize_state_dict), placed by `put`;
    None for the Llama families. A missing tensor raises ModelLoadError naming it."""
    if not uses_family_stages(cfg):
        return None

    def take(name: str) -> torch.Tensor:
        t = sd.pop(name, None)
        if t is None:
            raise ModelLoadError(f"weights are missing tensor '{name}'")
        return put(t)

    out = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        fw = FamilyLayerWeights()
        if cfg.qk_norm:
            fw.q_norm, fw.k_norm = take(p + "self_attn.q_norm.weight"), take(p + "self_attn.k_norm.weight")
        if cfg.gemma_norms:
            fw.post_attn_norm = take(p + "post_attn_norm.weight")
            fw.post_mlp_norm = take(p + "post_feedforward_layernorm.weight")
        out.append(fw)
    return out


def random_family_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype
                          ) -> list[FamilyLayerWeights] | None:
    """Extra weights for random_weights: q/k norms of ones (Gemma: zeros, its norms scale by
    1 + w), post norms of zeros."""
    if not uses_family_stages(cfg):
        return None
    fill = 0.0 if cfg.gemma_norms else 1.0
    d, h = cfg.head_dim, cfg.hidden_size
    out = []
    for _ in range(cfg.num_layers):
        fw = FamilyLayerWeights()
        if cfg.qk_norm:
            fw.q_norm = torch.full((d,), fill, device=device, dtype=dtype)
            fw.k_norm = torch.full((d,), fill, device=device, dtype=dtype)
        if cfg.gemma_norms:
            fw.post_attn_norm = torch.zeros(h, device=device, dtype=dtype)
            fw.post_mlp_norm = torch.zeros(h, device=device, dtype=dtype)
        out.append(fw)
    return out


def gemma_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: statistics and the scale in float32, rounded to x's dtype once at the end.
    w1 = 1 + w in float32 (gemma_scale)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w1).to(x.dtype)


def gemma_scale(w: torch.Tensor) -> torch.Tensor:
    """The float32 factor 1 + w Gemma's norms multiply by (as HF computes it at every call)."""
    return 1.0 + w.float()


def norm_fn(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """cfg's RMSNorm of x by a prepared weight (norm_weight's)."""
    eps = cfg.rms_eps
    if cfg.gemma_norms:
        return lambda x, w: gemma_norm(x, w, eps)
    return lambda x, w: rms_norm(x, w, eps)


def norm_weight(cfg: ModelConfig, w: torch.Tensor) -> torch.Tensor:
    """A norm weight as norm_fn takes it: Gemma's 1 + w in float32, others as stored."""
    return gemma_scale(w) if cfg.gemma_norms else w


def activation(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    if cfg.activation == "gelu_tanh":
        return lambda g: F.gelu(g, approximate="tanh")
    return F.silu


def rotary_dim(cfg: ModelConfig) -> int:
    return cfg.rotary_dim or cfg.head_dim


def apply_rope_part(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [N, heads, D] (the rest passes):
    HF's partial rotary values. cos / ssin [N, rot] (ssin: ops.signed_sin)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope_rolled(x, cos, ssin)
    return torch.cat((apply_rope_rolled(x[..., :rot], cos, ssin), x[..., rot:]), dim=-1)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """HF's default inverse frequencies, computed as it does (float32 torch ops)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _cos_sin(pos: torch.Tensor, inv: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def _longrope(cfg: ModelConfig, pos: torch.Tensor, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's (cos, sin) of the `which` ("short" / "long") factors, times attention_factor."""
    sc, dim = cfg.rope_scaling or {}, rotary_dim(cfg)
    base = cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / (torch.tensor(sc[f"{which}_factor"], dtype=torch.float32) * base)
    return _cos_sin(pos, inv, sc["attention_factor"])


def longrope_cut(cfg: ModelConfig) -> int | None:
    """LongRoPE's original context (positions from it on rotate by the long factors); None
    without LongRoPE."""
    sc = cfg.rope_scaling or {}
    return sc["original_max_position_embeddings"] if sc.get("rope_type") == "longrope" else None


def long_table(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """LongRoPE's long-factor (cos, sin) for every position (what a prompt that ends past the
    original context rotates all its rows by, as transformers does); None without LongRoPE."""
    if longrope_cut(cfg) is None:
        return None
    return _longrope(cfg, torch.arange(length, dtype=torch.float32), "long")


def prefill_table(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """LongRoPE's fused prefill tables [2 * length, rotary_dim]: rope_tables' rows, then
    long_table's (a prefill row's position plus length where its prompt ends past the original
    context); None without LongRoPE."""
    long = long_table(cfg, length)
    if long is None:
        return None
    cos, sin = rope_tables(cfg, length)[0]
    return torch.cat((cos, long[0])), torch.cat((sin, long[1]))


def rope_tables(cfg: ModelConfig, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Float32 (cos, sin) tables [length, rotary_dim], on the CPU: [global] or, with windowed
    layers, [global, local] (layer_table says which a layer reads). LongRoPE: positions below
    original_max_position_embeddings take the short factors, the others the long ones, both
    times attention_factor. transformers rotates a token at a time the same way, but where a
    sequence first passes the original context it recomputes the whole sequence with the long
    factors; here the rows cached before keep the short ones (as vLLM does)."""
    dim = rotary_dim(cfg)
    pos = torch.arange(length, dtype=torch.float32)
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    cut = longrope_cut(cfg)
    if cut is not None:
        short, long = _longrope(cfg, pos, "short"), _longrope(cfg, pos, "long")
        cut = min(cut, length)
        glob = (torch.cat((short[0][:cut], long[0][cut:])), torch.cat((short[1][:cut], long[1][cut:])))
    elif kind in ("llama3", "linear"):
        inv = torch.tensor(rope_inv_freq(dataclasses.replace(cfg, head_dim=dim)), dtype=torch.float32)
        glob = _cos_sin(pos, inv)
    else:
        glob = _cos_sin(pos, _default_inv_freq(cfg.rope_theta, dim))
    if not any(cfg.layer_windows):
        return [glob]
    return [glob, _cos_sin(pos, _default_inv_freq(cfg.local_rope_theta or 10_000.0, dim))]


def layer_table(cfg: ModelConfig, i: int) -> int:
    """Which of rope_tables' sets layer i rotates by (1: a windowed layer's own base)."""
    return 1 if cfg.layer_windows and cfg.layer_windows[i] else 0


def layer_window(cfg: ModelConfig, i: int) -> int:
    """Positions layer i attends to, the current one included (0: every position)."""
    return cfg.layer_windows[i] if cfg.layer_windows else 0


def attention_scale(cfg: ModelConfig) -> float:
    return cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """HF's final logit softcapping: cap * tanh(logits / cap)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def embed_scale(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Gemma's sqrt(hidden) as HF multiplies by it: a float32 scalar rounded to the model's dtype."""
    if not cfg.gemma_norms:
        return None
    return torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(device=device, dtype=dtype)
