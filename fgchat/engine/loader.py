"""Turns a --model argument into config, weights on the device and a tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from fgchat.engine.startup_trace import startup_mark
from fgchat.presets import preset_names, preset_path
from fgchat.protocol.errors import FgchatError, ModelLoadError, is_out_of_memory
from fgchat.engine.model.config import ModelConfig, parse_config
from fgchat.engine.model.decoder import DecoderWeights, random_weights, weights_from_state_dict


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


def load_preset_config(name: str) -> dict:
    path = preset_path(name)
    if not path.is_file():
        raise FgchatError(f"unknown preset '{name}'; known presets: {', '.join(preset_names())}")
    return json.loads(path.read_text())


def load_random(preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                outliers: float = 0.0) -> LoadedModel:
    """Random weights of a preset's shape; outliers > 0: with massive activation channels
    (decoder.random_weights)."""
    cfg = parse_config(load_preset_config(preset))
    name = f"{preset} (random weights{f', outliers {outliers:g}' if outliers > 0 else ''})"
    try:
        weights = random_weights(cfg, device, dtype, seed, outliers)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise ModelLoadError(_oom_message(device, f"preset {preset}", exc)) from None
        raise
    return LoadedModel(name, cfg, weights, None)


def _oom_message(device: torch.device, name: str, exc: BaseException) -> str:
    """One line for an allocation failure while loading. torch.OutOfMemoryError is the CUDA
    allocator's; MemoryError and the CPU allocator's RuntimeError mean host memory (weights are
    read to host memory before they are placed on the device)."""
    kind = "GPU" if isinstance(exc, torch.OutOfMemoryError) and device.type == "cuda" else "CPU"
    return (f"not enough {kind} memory to load {name} ({type(exc).__name__}); "
            "try a smaller model or dtype, or free memory")


def load_model(arg: str | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Resolve, read and place a model. Every failure is a ModelLoadError with one line."""
    from fgchat.engine.model.generation_config import (
        EMBEDDED_SAMPLING,
        EMBEDDED_SAMPLING_SOURCE,
        FILE_NAME,
        read_generation_config,
    )
    from fgchat.engine.model.resolve import resolve_model
    from fgchat.engine.model.tokenizer import Tokenizer
    from fgchat.engine.model.weights import load_safetensors, read_config

    resolved = resolve_model(arg)
    raw = read_config(resolved.path)
    cfg = parse_config(raw)
    tokenizer = Tokenizer.from_dir(resolved.path)
    try:
        state = load_safetensors(resolved.path)
        weights = weights_from_state_dict(cfg, state, device, dtype)
    except Exception as exc:  # MemoryError is an Exception too
        if is_out_of_memory(exc):
            raise ModelLoadError(_oom_message(device, f"model {resolved.name}", exc)) from None
        raise
    gen, note = read_generation_config(resolved.path)
    source = FILE_NAME if gen else ""
    if not gen and resolved.source == "embedded":
        gen, source = dict(EMBEDDED_SAMPLING), EMBEDDED_SAMPLING_SOURCE
    startup_mark("engine: model loaded")
    return LoadedModel(resolved.name, cfg, weights, tokenizer, gen, [note] if note else [], source)
