"""tools/random_gguf.py (llama.cpp's peer input): the tiny preset's GGUF read back with gguf's own
reader has the preset's hyperparameters, the llama architecture's tensors at their shapes, random
weights of std 0.02, norm weights 1 and a vocabulary of the preset's size."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fgchat.presets import preset_path

gguf = pytest.importorskip("gguf")  # a project dependency; the skip only guards a broken install

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("random_gguf", ROOT / "tools" / "random_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _values(reader, key):
    return reader.fields[key].contents()


def _floats(tensor) -> np.ndarray:
    data = np.asarray(tensor.data)
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_tiny_preset_round_trip(tmp_path, dtype):
    tool = _tool()
    cfg = json.loads(preset_path("tiny").read_text())
    path = tmp_path / f"tiny-{dtype}.gguf"
    tool.write("tiny", path, dtype, quiet=True)
    r = gguf.GGUFReader(str(path))

    assert _values(r, "general.architecture") == "llama"
    expect = {
        "llama.vocab_size": cfg["vocab_size"],
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": cfg["num_attention_heads"],
        "llama.attention.head_count_kv": cfg["num_key_value_heads"],
        "llama.rope.dimension_count": cfg["head_dim"],
        "llama.attention.key_length": cfg["head_dim"],
        "llama.attention.value_length": cfg["head_dim"],
        "tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
        "tokenizer.ggml.eos_token_id": cfg["eos_token_id"],
    }
    for key, value in expect.items():
        assert _values(r, key) == value, key
    assert _values(r, "llama.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert _values(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert _values(r, "general.file_type") == {"bf16": 32, "f16": 1, "f32": 0}[dtype]

    tokens = _values(r, "tokenizer.ggml.tokens")
    assert _values(r, "tokenizer.ggml.model") == "llama"
    assert len(tokens) == cfg["vocab_size"] == len(set(tokens))
    assert len(_values(r, "tokenizer.ggml.token_type")) == cfg["vocab_size"]
    assert "<0x0A>" in tokens  # SPM byte fallback (llama.cpp's newline token)

    # the llama architecture's tensors; tied embeddings: no output.weight; no RoPE scaling: no
    # rope_freqs. GGUF (ggml) shapes are the numpy shapes reversed: {n_embd, n_vocab}.
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    want = {"token_embd.weight": [h, v], "output_norm.weight": [h]}
    for i in range(cfg["num_hidden_layers"]):
        want |= {f"blk.{i}.attn_norm.weight": [h], f"blk.{i}.attn_q.weight": [h, q],
                 f"blk.{i}.attn_k.weight": [h, kv], f"blk.{i}.attn_v.weight": [h, kv],
                 f"blk.{i}.attn_output.weight": [q, h], f"blk.{i}.ffn_norm.weight": [h],
                 f"blk.{i}.ffn_gate.weight": [h, f], f"blk.{i}.ffn_up.weight": [h, f],
                 f"blk.{i}.ffn_down.weight": [f, h]}
    got = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert got == want
    assert len(r.tensors) == 2 + 9 * cfg["num_hidden_layers"]

    weight_type = {"bf16": gguf.GGMLQuantizationType.BF16, "f16": gguf.GGMLQuantizationType.F16,
                   "f32": gguf.GGMLQuantizationType.F32}[dtype]
    for t in r.tensors:
        x = _floats(t)
        if t.name.endswith("norm.weight"):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.all(x == 1.0), t.name
        else:
            assert t.tensor_type == weight_type, t.name
            assert x.std() == pytest.approx(0.02, rel=0.1), t.name
            assert abs(float(x.mean())) < 0.002, t.name


def test_llama3_rope_factors_and_untied_output():
    tool = _tool()
    cfg, _ = tool.load_config("llama-3.1-8b")
    plan = {name: shape for name, shape, _ in tool.tensor_plan(cfg)}
    assert plan["output.weight"] == (128256, 4096)  # llama-3.1-8b does not tie embeddings
    assert plan["rope_freqs.weight"] == (64,)
    factors = tool.rope_factors(cfg)
    # llama3 scaling (factor 8): high frequencies unscaled, low ones divided by the factor
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)
    assert np.all(np.diff(factors) >= 0)
