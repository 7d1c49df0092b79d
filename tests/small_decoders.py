"""Small decoder configs and weights for the fused-kernel checks that run under Triton's
interpreter in a subprocess (tests/test_prefill.py, tests/test_prefill_sharing.py)."""

from __future__ import annotations

import torch

from fgchat.engine.model.config import ModelConfig, parse_config
from fgchat.engine.model.decoder import DecoderWeights, random_weights


def small_config(heads: int, kv_heads: int, bias: bool) -> ModelConfig:
    """Two layers, head dim 16, vocabulary 300; Qwen2 (qkv bias) when `bias`, else Llama."""
    return parse_config(dict(architectures=["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"],
                             vocab_size=300, hidden_size=16 * heads, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=16, rope_theta=10000.0,
                             max_position_embeddings=512))


def scaled_weights(cfg: ModelConfig, dtype: torch.dtype, seed: int = 3) -> DecoderWeights:
    """Random weights with the projections 4x the default init, so the logits are not all ties."""
    w = random_weights(cfg, torch.device("cpu"), dtype, seed)
    for lw in w.layers:
        for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down):
            t.mul_(4)
    return w
