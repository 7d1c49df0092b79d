"""Turns a --model argument into config, weights on the device and a tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fgchat.engine.errors import FgchatError, ModelLoadError
from fgchat.engine.model.config import ModelConfig, parse_config
from fgchat.engine.model.decoder import DecoderWeights, random_weights, weights_from_state_dict

PRESETS_DIR = Path(__file__).resolve().parent.parent.parent / "assets" / "presets"

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class LoadedModel:
    name: str
    cfg: ModelConfig
    weights: DecoderWeights
    tokenizer: object | None  # fgchat.engine.model.tokenizer.Tokenizer; None for random weights


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FgchatError("CUDA was requested but no CUDA device is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise FgchatError(f"unknown device '{name}' (use auto, cpu or cuda)") from None


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise FgchatError(f"unknown dtype '{name}' (use bfloat16, float16 or float32)")
    return DTYPES[name]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset_config(name: str) -> dict:
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        raise FgchatError(f"unknown preset '{name}'; known presets: {', '.join(preset_names())}")
    return json.loads(path.read_text())


def load_random(preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                outliers: float = 0.0) -> LoadedModel:
    """Random weights of a preset's shape; outliers > 0: with massive activation channels
    (decoder.random_weights)."""
    cfg = parse_config(load_preset_config(preset))
    name = f"{preset} (random weights{f', outliers {outliers:g}' if outliers > 0 else ''})"
    return LoadedModel(name, cfg, random_weights(cfg, device, dtype, seed, outliers), None)


def load_model(arg: str | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Resolve, read and place a model. Every failure is a ModelLoadError with one line."""
    from fgchat.engine.model.resolve import resolve_model
    from fgchat.engine.model.tokenizer import Tokenizer
    from fgchat.engine.model.weights import load_safetensors, read_config

    resolved = resolve_model(arg)
    raw = read_config(resolved.path)
    cfg = parse_config(raw)
    tokenizer = Tokenizer.from_dir(resolved.path)
    state = load_safetensors(resolved.path)
    try:
        weights = weights_from_state_dict(cfg, state, device, dtype)
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"not enough {device.type} memory to hold {resolved.name}") from None
    return LoadedModel(resolved.name, cfg, weights, tokenizer)
