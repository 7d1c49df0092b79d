"""A GGUF of an architecture quant.gguf_tensors reads whole ("llama", "qwen2") loads from the file
alone: its conversion holds config, tokenizer and marker, no float copy of the weights, and the
state built from the file equals the one built from transformers' float32 conversion with our
blocks put in, tensor by tensor (planes, and values dequantized). --dequantize gives transformers'
values. Float GGUFs written from the tiny Hugging Face models (qwen2 with biases, llama with
llama.cpp's q / k row order) load to exactly their safetensors' weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fgchat.engine.loader import _use_gguf_blocks, gguf_state, load_model
from fgchat.engine.model import resolve as resolve_mod
from fgchat.engine.model.config import parse_config
from fgchat.engine.model.decoder import weights_from_state_dict
from fgchat.engine.model.weights import load_safetensors, read_config
from fgchat.engine.quant.dequant import dense
from fgchat.engine.quant.qweight import QuantWeight
from fgchat.protocol.errors import ModelLoadError
from quant_gguf_files import llama_cpp_permute, write_gguf

pytest.importorskip("gguf")
CPU, F32 = torch.device("cpu"), torch.float32
TINY_Q4_K_M = Path(__file__).parent / "data" / "tiny-Q4_K_M.gguf"
# the files a conversion writes besides the weights and its marker
METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja")


def _same_state(old: dict, new: dict) -> None:
    assert set(old) == set(new)
    for name, a in old.items():
        b = new[name]
        assert type(a) is type(b), name
        if isinstance(a, QuantWeight):
            assert (a.fmt, a.shape, a.dtype, set(a.planes)) == (b.fmt, b.shape, b.dtype, set(b.planes)), name
            assert all(torch.equal(a.planes[k], b.planes[k]) for k in a.planes), name
        assert torch.equal(dense(a, F32), dense(b, F32)), name


def _weights_equal(a, b) -> None:
    """Two DecoderWeights hold equal values (plain or quantized, compared dequantized)."""
    pairs = [(a.embed, b.embed), (a.final_norm, b.final_norm), (a.lm_head, b.lm_head)]
    for la, lb in zip(a.layers, b.layers, strict=True):
        pairs += [(getattr(la, n), getattr(lb, n)) for n in ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm",
                                                            "w_gate_up", "w_down")]
    for x, y in pairs:
        assert (x is None) == (y is None)
        if x is not None:
            assert type(x) is type(y) and torch.equal(dense(x, F32), dense(y, F32))
    assert (a.lm_head is a.embed) == (b.lm_head is b.embed)


def _check_file(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    full = tmp_path / "full"
    resolve_mod.convert_gguf(gguf, full, with_weights=True)  # today's: transformers' float32 copy
    assert resolve_mod.has_weights(full)
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))
    conv = resolve_mod.resolve_model(str(gguf)).path
    assert not resolve_mod.has_weights(conv) and not list(conv.glob("*.safetensors"))
    for name in METADATA:  # the same metadata as the full conversion, byte for byte
        assert (conv / name).read_bytes() == (full / name).read_bytes(), name

    cfg = parse_config(read_config(conv))
    old = load_safetensors(full)
    _use_gguf_blocks(old, gguf, cfg, torch.bfloat16)
    new, notes = gguf_state(gguf, cfg, torch.bfloat16)
    assert notes == []
    _same_state(old, new)

    loaded = load_model(str(gguf), CPU, F32)
    assert loaded.weight_format == fmt
    assert any(f"{fmt} weights run on CPU" in n for n in loaded.notes)
    plain = load_model(str(gguf), CPU, F32, dequantize=True)
    assert plain.notes == [] and plain.weight_format == "fp32"
    theirs = weights_from_state_dict(cfg, load_safetensors(full), CPU, F32)  # transformers' values
    _weights_equal(plain.weights, theirs)
    _weights_equal(loaded.weights, theirs)


def test_llama_cpp_file_loads_from_the_file_alone(tmp_path, monkeypatch):
    _check_file(TINY_Q4_K_M, tmp_path, monkeypatch, "Q4_K+Q6_K")


@pytest.mark.slow
def test_embedded_file_loads_from_the_file_alone(tmp_path, monkeypatch):
    _check_file(resolve_mod.embedded_gguf_path(), tmp_path, monkeypatch, "Q4_1+Q8_0")


# ------------------------------------------------------------ float GGUFs of the tiny models
_ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, role = base.split(".", 3)
        return f"blk.{i}.{_ROLES[role]}.{suffix}"
    return f"{_TOP[base]}.{suffix}"


def _float_gguf(model_dir: Path, arch: str, out: Path, sd: dict | None = None) -> Path:
    """The model's float32 tensors as a GGUF of `arch` ("llama": q / k rows as llama.cpp stores them)."""
    cfg = parse_config(read_config(model_dir))
    tensors = {}
    for name, t in (sd or load_safetensors(model_dir)).items():
        w = t.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = llama_cpp_permute(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        tensors[_gguf_name(name)] = (np.ascontiguousarray(w), "F32")
    return write_gguf(out, arch, tensors)


def _as_converted(model_dir: Path, tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve `gguf` to a copy of model_dir without its weights (what the conversion writes)."""
    conv = tmp_path / "conv"
    shutil.copytree(model_dir, conv, ignore=shutil.ignore_patterns("*.safetensors*"))
    monkeypatch.setattr(resolve_mod, "resolve_model",
                        lambda arg, cache_dir=None: resolve_mod.ResolvedModel(conv, gguf.stem, "gguf"))


@pytest.mark.parametrize("family, arch", [("qwen2", "qwen2"), ("llama", "llama")])
def test_float_gguf_loads_the_models_own_weights(tiny_model_dirs, tmp_path, monkeypatch, family, arch):
    model_dir = tiny_model_dirs[family]
    gguf = _float_gguf(model_dir, arch, tmp_path / f"{family}.gguf")
    _as_converted(model_dir, tmp_path, gguf, monkeypatch)
    cfg = parse_config(read_config(model_dir))
    assert cfg.qkv_bias == (family == "qwen2")
    state, notes = gguf_state(gguf, cfg, F32)
    want = load_safetensors(model_dir)
    assert notes == [] and set(state) == set(want)
    assert all(torch.equal(state[n], want[n].float()) for n in want)
    loaded = load_model(str(gguf), CPU, F32)
    _weights_equal(loaded.weights, weights_from_state_dict(cfg, load_safetensors(model_dir), CPU, F32))


def test_tensor_off_its_config_shape_is_one_line(tiny_model_dirs, tmp_path, monkeypatch):
    model_dir = tiny_model_dirs["qwen2"]
    sd = load_safetensors(model_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = sd[name][:, :-2]
    gguf = _float_gguf(model_dir, "qwen2", tmp_path / "bad.gguf", sd)
    _as_converted(model_dir, tmp_path, gguf, monkeypatch)
    with pytest.raises(ModelLoadError, match=rf"bad.gguf: tensor {name} is \(\d+, \d+\) but its config asks"):
        load_model(str(gguf), CPU, F32)
