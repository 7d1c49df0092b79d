"""Loading quantized weights (CPU): a GGUF file's kept blocks as QuantWeight in DecoderWeights
(the CUDA structure), dequantized copies on CPU with one note, unsupported types named, the float32
reference over dequantized values, --quantize fp8 / int4 of random weights, and the embedded
model's own Q4_1 against today's conversion path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quant_gguf_files import llama_blocks_gguf

from fgchat.engine.loader import load_model, load_random
from fgchat.engine.model import resolve as resolve_mod
from fgchat.engine.model.config import parse_config
from fgchat.engine.model.decoder import Decoder, weights_from_state_dict
from fgchat.engine.model.quant_weights import dequantize_all
from fgchat.engine.quant.describe import weight_bytes, weight_format
from fgchat.engine.model.reference import reference_logits
from fgchat.engine.model.weights import load_safetensors, read_config
from fgchat.engine.quant.dequant import dequantize
from fgchat.engine.quant.qweight import QuantStack, QuantWeight
from fgchat.engine.quant.quantize import quantize
from fgchat.protocol.errors import ModelLoadError

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
# GGUF type per projection of the tiny GGUF (k: a type we do not keep)
TYPES = {"attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}
def _gguf_dequant(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), heads, heads).copy())


@pytest.fixture
def tiny_gguf(tiny_llama, tmp_path, monkeypatch):
    """A "llama" GGUF of the tiny llama's shapes (random blocks, llama.cpp's q / k row order),
    resolved as if the tiny llama's directory were its conversion. Returns (path, raw tensors)."""
    path = tmp_path / "tiny.gguf"
    tensors, cfg = llama_blocks_gguf(tiny_llama, path, TYPES, "Q8_0", seed=5)
    monkeypatch.setattr(resolve_mod, "resolve_model",
                        lambda arg, cache_dir=None: resolve_mod.ResolvedModel(tiny_llama, "tiny-gguf", "gguf"))
    return path, tensors, cfg


def test_gguf_blocks_in_decoder_weights_and_reference(tiny_gguf, tiny_llama):
    """The CUDA structure, built on CPU: kept blocks stay QuantWeight (one format) or QuantStack
    (gate Q4_1 | up Q8_0); a fused weight with an unsupported part is plain. The float32
    reference over it equals the reference over its dequantized copy."""
    from fgchat.engine.loader import _use_gguf_blocks

    path, tensors, cfg = tiny_gguf
    state = load_safetensors(tiny_llama)
    notes = _use_gguf_blocks(state, path, cfg, torch.float32)
    assert len(notes) == 1 and "Q5_0 (2 tensors)" in notes[0]
    w = weights_from_state_dict(cfg, state, CPU, torch.float32)
    lw = w.layers[0]
    assert isinstance(lw.wqkv, torch.Tensor)  # q Q8_0 | k Q5_0 (dequantized) | v Q8_0
    assert isinstance(lw.wo, QuantWeight) and lw.wo.fmt == "Q4_0"
    assert isinstance(lw.w_gate_up, QuantStack) and lw.w_gate_up.fmt == "Q4_1+Q8_0"
    assert lw.w_gate_up.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert isinstance(w.embed, QuantWeight) and w.embed.fmt == "Q8_0"
    assert weight_format(w) == "fp32+Q8_0+Q4_0+Q4_1"  # by bytes: the qkv left plain, then the rest
    held = weight_bytes(w)
    ids = torch.tensor([3, 17, 5, 9, 30])
    dec = Decoder(cfg, _dense_copy(w), 64)
    ref_quant = reference_logits(cfg, w, ids, dec.cos, dec.sin, dec.scale)
    assert dequantize_all(w, torch.float32) and weight_bytes(w) > held
    ref_dense = reference_logits(cfg, w, ids, dec.cos, dec.sin, dec.scale)
    assert torch.equal(ref_quant, ref_dense)


def _dense_copy(w):
    import copy

    out = copy.deepcopy(w)
    dequantize_all(out, torch.float32)
    return out


def test_gguf_on_cpu_runs_dequantized_values_with_notes(tiny_gguf, tiny_llama):
    path, tensors, cfg = tiny_gguf
    loaded = load_model(str(path), CPU, torch.float32)
    assert loaded.weight_format == "fp32+Q8_0+Q4_0+Q4_1"
    assert len(loaded.notes) == 2, loaded.notes
    assert "Q5_0 (2 tensors)" in loaded.notes[0] and "float32" in loaded.notes[0]
    assert "Q8_0+Q4_0+Q4_1 weights run on CPU as float32 copies" in loaded.notes[1]
    w = loaded.weights
    conv = load_safetensors(tiny_llama)
    for i, lw in enumerate(w.layers):
        assert all(isinstance(t, torch.Tensor) for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down, w.embed))
        q = _unpermute(_gguf_dequant(*tensors[f"blk.{i}.attn_q.weight"]), cfg.num_heads)
        v = _gguf_dequant(*tensors[f"blk.{i}.attn_v.weight"])
        k = conv[f"model.layers.{i}.self_attn.k_proj.weight"]  # not kept: the conversion's values
        assert torch.equal(lw.wqkv, torch.cat([q, k, v]))
        assert torch.equal(lw.wo, _gguf_dequant(*tensors[f"blk.{i}.attn_output.weight"]))
        gate_up = torch.cat([_gguf_dequant(*tensors[f"blk.{i}.ffn_{n}.weight"]) for n in ("gate", "up")])
        assert torch.equal(lw.w_gate_up, gate_up)
        assert torch.equal(lw.w_down, _gguf_dequant(*tensors[f"blk.{i}.ffn_down.weight"]))
    assert torch.equal(w.embed, _gguf_dequant(*tensors["token_embd.weight"]))
    # --dequantize: today's path, the conversion's weights as they are
    plain = load_model(str(path), CPU, torch.float32, dequantize=True)
    assert plain.notes == [] and plain.weight_format == "fp32"
    assert torch.equal(plain.weights.layers[0].wo, conv["model.layers.0.self_attn.o_proj.weight"])
    with pytest.raises(ModelLoadError, match="--quantize fp8 is for bf16/fp16 weights"):
        load_model(str(path), CPU, torch.float32, quantize="fp8")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantize_random_weights_generate_on_cpu(fmt):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams

    dtype = torch.bfloat16
    plain = load_random("tiny", CPU, dtype, seed=3)
    loaded = load_random("tiny", CPU, dtype, seed=3, quantize=fmt)
    assert loaded.weight_format == f"{fmt}+bf16"  # the projections, then the LM head left in bf16
    assert len(loaded.notes) == 1 and f"{fmt}+bf16 weights run on CPU" in loaded.notes[0]
    for a, b in zip(plain.weights.layers, loaded.weights.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            want = dequantize(quantize(getattr(a, name), fmt), dtype)
            assert torch.equal(getattr(b, name), want) and not torch.equal(getattr(b, name), getattr(a, name))
    assert torch.equal(loaded.weights.embed, plain.weights.embed)  # embedding and head stay as they are
    eng = Engine(EngineConfig(preset="tiny", device="cpu", dtype="bfloat16", seed=3, quantize=fmt,
                              max_context=128), loaded)
    assert any(f"{fmt}+bf16 weights run on CPU" in n for n in eng.notes)
    rid = eng.submit([5, 9, 11, 2], SamplingParams(max_tokens=8, ignore_eos=True))
    done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    assert len(done[rid].token_ids) == 8
    # the start-up reference runs over the engine's weights: the dequantized values
    ids = torch.tensor([5, 9, 11, 2])
    dec = eng.decoder
    got = reference_logits(eng.cfg, dec.w, ids, dec.cos, dec.sin, dec.scale)
    assert not torch.equal(got, reference_logits(eng.cfg, plain.weights, ids, dec.cos, dec.sin, dec.scale))


def test_int4_refuses_widths_off_its_group():
    with pytest.raises(ModelLoadError, match="multiples of 128.*576"):
        load_random("smollm2-135m", CPU, torch.bfloat16, quantize="int4")
    with pytest.raises(ModelLoadError, match="unknown --quantize format 'int3'"):
        load_random("tiny", CPU, torch.bfloat16, quantize="int3")


@pytest.mark.slow
def test_embedded_q4_1_planes_equal_conversion_and_greedy_tokens(tmp_path):
    """The embedded GGUF (Q4_1, Q8_0 token_embd, tied head): every tensor's planes dequantize to
    the transformers conversion's float32 tensor bit for bit (q / k rows unpermuted), and the model
    loaded from its blocks (dequantized on CPU) answers with today's conversion path's greedy tokens."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.quant.dequant import dense
    from fgchat.engine.quant.gguf_tensors import read_gguf_weights
    from fgchat.protocol.events import RequestFinished, SamplingParams

    conv_dir = tmp_path / "full"
    resolve_mod.convert_gguf(resolve_mod.embedded_gguf_path(), conv_dir, with_weights=True)
    conv = load_safetensors(conv_dir)
    cfg = parse_config(read_config(conv_dir))
    read = read_gguf_weights(resolve_mod.embedded_gguf_path(), cfg.num_heads, cfg.num_kv_heads)
    assert read.formats() == ["Q8_0", "Q4_1"] and read.other_types == {}
    assert set(read.tensors) == set(conv)
    for name, t in read.tensors.items():
        assert torch.equal(dense(t, torch.float32), conv[name]), name

    def greedy(**kw) -> tuple[list[list[int]], Engine]:
        eng = Engine(EngineConfig(device="cpu", dtype="float32", max_context=256, self_check=False, **kw))
        out = []
        for text in ("What is the capital of France?",):  # the planes' equality above covers every tensor
            ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            rid = eng.submit(ids, SamplingParams(max_tokens=8, ignore_eos=True))
            done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
            out.append(done[rid].token_ids)
        return out, eng

    ours, eng = greedy()
    assert eng.model.weight_format == "Q4_1+Q8_0" and any("Q4_1+Q8_0 weights run on CPU" in n for n in eng.notes)
    theirs, _ = greedy(model=str(conv_dir))  # transformers' float32 conversion, as a model directory
    assert ours == theirs and all(len(t) == 8 for t in ours)
    assert greedy(dequantize=True)[0] == ours
