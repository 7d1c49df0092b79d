"""Turns a --model argument into config, weights on the device and a tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fgchat.engine.startup_trace import startup_mark
from fgchat.presets import preset_names, preset_path
from fgchat.protocol.errors import FgchatError, ModelLoadError, is_out_of_memory
from fgchat.engine.model.config import ModelConfig, parse_config
from fgchat.engine.model.decoder import DecoderWeights, random_weights, weights_from_state_dict

if TYPE_CHECKING:
    from fgchat.engine.quant.gguf_tensors import GgufWeights


@dataclass
class LoadedModel:
    name: str
    cfg: ModelConfig
    weights: DecoderWeights
    tokenizer: object | None  # fgchat.engine.model.tokenizer.Tokenizer; None for random weights
    # the sampling keys of the model's generation_config.json (model.generation_config); empty
    # when it has none or states no sampling, and for random weights
    generation_config: dict = field(default_factory=dict)
    # one-line notes about loading the engine may show (e.g. a malformed generation_config.json)
    notes: list[str] = field(default_factory=list)
    # where generation_config came from, shown as EngineInfo.sampling_source ("" when it is empty)
    sampling_source: str = ""
    # the projections' weight format as loaded (quant.describe.weight_format: "Q4_1", "int4",
    # "bfloat16", ...); on CPU, the format the dequantized copies were made from
    weight_format: str = ""


def load_preset_config(name: str) -> dict:
    path = preset_path(name)
    if not path.is_file():
        raise FgchatError(f"unknown preset '{name}'; known presets: {', '.join(preset_names())}")
    return json.loads(path.read_text())


def load_random(preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                outliers: float = 0.0, quantize: str = "none") -> LoadedModel:
    """Random weights of a preset's shape; outliers > 0: with massive activation channels
    (decoder.random_weights); quantize: fp8 / int4 projections (model.quant_weights)."""
    cfg = parse_config(load_preset_config(preset))
    _check_quantize(cfg, quantize)
    name = f"{preset} (random weights{f', outliers {outliers:g}' if outliers > 0 else ''})"
    try:
        weights = random_weights(cfg, device, dtype, seed, outliers)
        fmt, notes = _settle_quantized(weights, device, dtype, quantize)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise ModelLoadError(_oom_message(device, f"preset {preset}", exc)) from None
        raise
    return LoadedModel(name, cfg, weights, None, notes=notes, weight_format=fmt)


def _check_quantize(cfg: ModelConfig, quantize: str) -> None:
    from fgchat.engine.model.quant_weights import check_quantize

    problem = check_quantize(cfg, quantize)
    if problem:
        raise ModelLoadError(problem)


def _settle_quantized(weights: DecoderWeights, device: torch.device, dtype: torch.dtype,
                      quantize: str) -> tuple[str, list[str]]:
    """--quantize the projections, then, on CPU, replace every quantized weight by its
    dequantized copy in `dtype`. Returns the weight format and the note saying so (CPU)."""
    from fgchat.engine.model.quant_weights import dequantize_all, quantize_projections
    from fgchat.engine.quant.describe import weight_format

    if quantize != "none":
        quantize_projections(weights, quantize)
    fmt = weight_format(weights)
    notes = []
    if device.type == "cpu" and dequantize_all(weights, dtype):
        notes.append(f"{fmt} weights run on CPU as {str(dtype).removeprefix('torch.')} copies of their "
                     "dequantized values (the reference the GPU kernels are checked against)")
    return fmt, notes


def _gguf_file(arg: str | None, source: str) -> Path | None:
    """The GGUF file a resolved model was converted from; None for other sources."""
    from fgchat.engine.model.resolve import embedded_gguf_path

    if source == "embedded":
        return embedded_gguf_path()
    if source == "gguf" and arg is not None:
        return Path(arg.strip()).expanduser()
    return None


def _read_gguf(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> GgufWeights:
    """The GGUF file's decoder tensors (quant.gguf_tensors), its quantized ones set to meet `dtype`."""
    from fgchat.engine.quant.gguf_tensors import read_gguf_weights
    from fgchat.engine.quant.qweight import QuantWeight

    try:
        read = read_gguf_weights(path, cfg.num_heads, cfg.num_kv_heads)
    except Exception as exc:  # a file the conversion read but our reader cannot: one line
        if is_out_of_memory(exc):
            raise
        raise ModelLoadError(f"cannot read the tensors of {path.name}: {type(exc).__name__}: {exc}") from None
    for t in read.tensors.values():
        if isinstance(t, QuantWeight):
            t.dtype = dtype  # the activations it meets and what dequantizing it gives
    return read


def _other_types_note(other_types: dict[str, int], dtype: torch.dtype) -> list[str]:
    if not other_types:
        return []
    types = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(other_types.items()))
    return [f"GGUF tensor types not kept in their format: {types}; those tensors (and the fused "
            f"projections they belong to) run dequantized to {str(dtype).removeprefix('torch.')}"]


def _use_gguf_blocks(state: dict, path: Path, cfg: ModelConfig, dtype: torch.dtype) -> list[str]:
    """Put the GGUF file's quantized projections, embedding and LM head (quant.gguf_tensors)
    into `state` (the conversion's tensors, by name) in place of their dequantized copies.
    Returns the note naming the tensor types that are not kept as they are (if any)."""
    from fgchat.engine.quant.qweight import QuantWeight

    read = _read_gguf(path, cfg, dtype)
    for name, t in read.tensors.items():
        if not isinstance(t, QuantWeight) or name not in state:
            continue
        if tuple(state[name].shape) != t.shape:
            raise ModelLoadError(f"{path.name}: tensor {name} is {t.shape} in the file but "
                                 f"{tuple(state[name].shape)} in its conversion")
        state[name] = t
    return _other_types_note(read.other_types, dtype)


def gguf_state(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> tuple[dict, list[str]]:
    """The whole state of a GGUF whose conversion holds no weights, from the file alone: blocks as
    QuantWeight, float tensors as they are stored, each shape checked against `cfg` (a file whose
    metadata and tensors disagree is one line). Returns it with _use_gguf_blocks' note."""
    read = _read_gguf(path, cfg, dtype)
    for name, t in read.tensors.items():
        want = _expected_shape(name, cfg)
        if want is not None and tuple(t.shape) != want:
            raise ModelLoadError(f"{path.name}: tensor {name} is {tuple(t.shape)} but its config "
                                 f"asks for {want}")
    return read.tensors, _other_types_note(read.other_types, dtype)


def _expected_shape(name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """The shape `cfg` gives the Hugging Face tensor `name` (None: a name not checked here)."""
    h, q, kv, inter, vocab = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,),
    }
    return shapes.get(name.split(".", 3)[-1] if name.startswith("model.layers.") else name)


def _oom_message(device: torch.device, name: str, exc: BaseException) -> str:
    """One line for an allocation failure while loading. torch.OutOfMemoryError is the CUDA
    allocator's; MemoryError and the CPU allocator's RuntimeError mean host memory (weights are
    read to host memory before they are placed on the device)."""
    kind = "GPU" if isinstance(exc, torch.OutOfMemoryError) and device.type == "cuda" else "CPU"
    return (f"not enough {kind} memory to load {name} ({type(exc).__name__}); "
            "try a smaller model or dtype, or free memory")


def load_model(arg: str | None, device: torch.device, dtype: torch.dtype, quantize: str = "none",
               dequantize: bool = False) -> LoadedModel:
    """Resolve, read and place a model. Every failure is a ModelLoadError with one line.
    A GGUF file keeps its quantized blocks (dequantize=True: their dequantized values in `dtype`);
    its tensors come from the file alone when its conversion holds no weights (resolve.has_weights).
    quantize: fp8 / int4 projections made from float weights at load."""
    from fgchat.engine.model.generation_config import (
        EMBEDDED_SAMPLING,
        EMBEDDED_SAMPLING_SOURCE,
        FILE_NAME,
        read_generation_config,
    )
    from fgchat.engine.model.quant_weights import dequantize_all
    from fgchat.engine.model.resolve import has_weights, resolve_model
    from fgchat.engine.model.tokenizer import Tokenizer
    from fgchat.engine.model.weights import load_safetensors, read_config

    resolved = resolve_model(arg)
    raw = read_config(resolved.path)
    cfg = parse_config(raw)
    _check_quantize(cfg, quantize)
    gguf = _gguf_file(arg, resolved.source)
    from_file = gguf is not None and not has_weights(resolved.path)
    if gguf is not None and not dequantize and quantize != "none":
        raise ModelLoadError(f"--quantize {quantize} is for bf16/fp16 weights; {resolved.name} is a GGUF file "
                             "that runs in its own format (add --dequantize to quantize its dequantized weights)")
    tokenizer = Tokenizer.from_dir(resolved.path)
    notes = []
    try:
        if from_file:
            state, gguf_notes = gguf_state(gguf, cfg, dtype)
        else:
            state = load_safetensors(resolved.path)
            gguf_notes = _use_gguf_blocks(state, gguf, cfg, dtype) if gguf is not None and not dequantize else []
        weights = weights_from_state_dict(cfg, state, device, dtype)
        if dequantize:
            dequantize_all(weights, dtype)
        else:
            notes += gguf_notes
        fmt, quant_notes = _settle_quantized(weights, device, dtype, quantize)
    except Exception as exc:  # MemoryError is an Exception too
        if is_out_of_memory(exc):
            raise ModelLoadError(_oom_message(device, f"model {resolved.name}", exc)) from None
        raise
    gen, note = read_generation_config(resolved.path)
    source = FILE_NAME if gen else ""
    if not gen and resolved.source == "embedded":
        gen, source = dict(EMBEDDED_SAMPLING), EMBEDDED_SAMPLING_SOURCE
    startup_mark("engine: model loaded")
    notes += quant_notes + ([note] if note else [])
    return LoadedModel(resolved.name, cfg, weights, tokenizer, gen, notes, source, fmt)
