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


def _tiny_of(preset: str, tmp_path: Path, **sizes) -> tuple[Path, dict]:
    """The preset's own config.json with tiny sizes: tmp_path/<preset>-tiny/config.json."""
    cfg = json.loads(preset_path(preset).read_text()) | sizes
    folder = tmp_path / f"{preset}-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "config.json", cfg


# the tensors llama.cpp's load_arch_tensors creates for each layer (src/models/qwen3.cpp, gemma3.cpp at
# the commit in .llamacpp/src.tgz), by ggml shape with H hidden, D head_dim, Q heads x D, K kv heads x D
LAYER = {
    "qwen3": {"attn_norm": "H", "attn_q": "H,Q", "attn_k": "H,K", "attn_v": "H,K", "attn_output": "Q,H",
              "attn_q_norm": "D", "attn_k_norm": "D", "ffn_norm": "H", "ffn_gate": "H,F", "ffn_up": "H,F",
              "ffn_down": "F,H"},
}
LAYER["gemma3"] = LAYER["qwen3"] | {"post_attention_norm": "H", "post_ffw_norm": "H"}


@pytest.mark.parametrize("preset,arch,sizes", [
    ("qwen3-0.6b", "qwen3", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                             "vocab_size": 1536, "bos_token_id": 1, "eos_token_id": 2}),
    # hidden != heads x head_dim, as in gemma-3-1b; pattern 3 puts a global layer among 3
    ("gemma-3-1b", "gemma3", {"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                              "query_pre_attn_scalar": 64, "vocab_size": 1280, "sliding_window": 16,
                              "sliding_window_pattern": 3, "rope_local_base_freq": 20000.0}),
])
def test_family_round_trip(tmp_path, preset, arch, sizes):
    tool = _tool()
    config, cfg = _tiny_of(preset, tmp_path, **sizes)
    path = tmp_path / "model.gguf"
    tool.write(str(config), path, "bf16", quiet=True)
    r = gguf.GGUFReader(str(path))

    assert _values(r, "general.architecture") == arch
    assert _values(r, "general.name") == f"{preset}-tiny (random weights, bf16)"
    layers, d = cfg["num_hidden_layers"], cfg["head_dim"]
    expect = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "block_count": layers, "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": d, "attention.value_length": d, "rope.dimension_count": d,
    }
    if arch == "gemma3":  # layer i is global where (i + 1) % pattern == 0 (transformers' layer_types)
        pattern = cfg["sliding_window_pattern"]
        expect |= {"attention.sliding_window": cfg["sliding_window"],
                   "attention.sliding_window_pattern": [(i + 1) % pattern != 0 for i in range(layers)]}
        assert _values(r, "gemma3.rope.freq_base_swa") == pytest.approx(cfg["rope_local_base_freq"])
        assert "gemma3.final_logit_softcapping" not in r.fields  # null in the preset
    for key, value in expect.items():
        assert _values(r, f"{arch}.{key}") == value, key
    assert _values(r, f"{arch}.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert _values(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert f"{arch}.rope.scaling.type" not in r.fields
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]
    assert _values(r, "tokenizer.ggml.eos_token_id") == eos
    assert _values(r, "tokenizer.ggml.bos_token_id") == cfg["bos_token_id"]
    assert len(_values(r, "tokenizer.ggml.tokens")) == cfg["vocab_size"]

    # every name is in gguf-py's tensor table of the architecture; the set and the shapes are
    # what llama.cpp's loader asks for; tied embeddings: no output.weight
    table = {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight"
             for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]] for i in range(layers)}
    dims = {"H": cfg["hidden_size"], "D": d, "F": cfg["intermediate_size"],
            "Q": cfg["num_attention_heads"] * d, "K": cfg["num_key_value_heads"] * d}
    want = {"token_embd.weight": [cfg["hidden_size"], cfg["vocab_size"]], "output_norm.weight": [cfg["hidden_size"]]}
    for i in range(layers):
        want |= {f"blk.{i}.{n}.weight": [dims[c] for c in s.split(",")] for n, s in LAYER[arch].items()}
    got = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert got == want
    assert set(got) <= table, set(got) - table
    for t in r.tensors:
        x = _floats(t)
        if t.name.endswith("norm.weight"):  # Gemma's too: the converter stores 1 + w, w = 0
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(x == 1.0), t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16, t.name
            assert x.std() == pytest.approx(0.02, rel=0.1), t.name


def test_gemma_linear_scaling_softcap_and_query_scale(tmp_path, capsys):
    tool = _tool()
    config, cfg = _tiny_of("gemma-3-1b", tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=600,
                           rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=30.0,
                           query_pre_attn_scalar=64)
    tool.write(str(config), tmp_path / "m.gguf", "f32", quiet=True)
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    # the global layers' scaling as llama.cpp's generic keys (its SWA layers keep scale 1), no rope_freqs
    assert _values(r, "gemma3.rope.scaling.type") == "linear"
    assert _values(r, "gemma3.rope.scaling.factor") == pytest.approx(8.0)
    assert _values(r, "gemma3.final_logit_softcapping") == pytest.approx(30.0)
    assert "rope_freqs.weight" not in {t.name for t in r.tensors}
    # llama.cpp takes 1/sqrt(head_dim) = 1/sqrt(32), the preset 1/sqrt(64): said, not refused
    assert "llama.cpp scales queries by 0.176777, the preset by 0.125" in capsys.readouterr().err


@pytest.mark.parametrize("preset,edit,needle", [
    ("qwen2.5-1.5b", {}, "Qwen2ForCausalLM is not written"),
    ("llama-3.2-1b", {"attention_bias": True}, "LlamaForCausalLM with qkv bias is not written"),
    ("qwen3-0.6b", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "llama3 RoPE scaling is written for llama presets only"),
    ("phi-4-mini", {}, "Phi3ForCausalLM is not written"),
])
def test_refused_configs(tmp_path, preset, edit, needle):
    tool = _tool()
    config, _ = _tiny_of(preset, tmp_path, **edit)
    with pytest.raises(SystemExit, match=needle):
        tool.load_config(str(config))
