"""Small decoder configs and weights for the fused-kernel checks that run under Triton's
interpreter in a subprocess (tests/engine/test_prefill.py, tests/engine/test_prefill_sharing.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fgchat.engine.model.config import ModelConfig, parse_config
from fgchat.engine.model.decoder import DecoderWeights, LayerWeights, random_weights


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


def run_interpreted(script: str, cases: list) -> list[dict]:
    """Run `script` (python -c, cases as its JSON argument) under TRITON_INTERPRET=1 from the
    repository root; the dicts of the line it prints as "RESULT <json list>"."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True,
                          text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def as_float32(w: DecoderWeights) -> DecoderWeights:
    """The same (bf16-representable) weights in float32: the reference both paths aim at."""
    f = lambda t: None if t is None else t.float()  # noqa: E731
    layers = [LayerWeights(*(f(getattr(lw, k.name)) for k in dataclasses.fields(LayerWeights)))
              for lw in w.layers]
    embed = f(w.embed)
    head = embed if w.lm_head is w.embed else f(w.lm_head)
    return DecoderWeights(embed, layers, f(w.final_norm), head)
