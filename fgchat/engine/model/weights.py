"""Reading config.json and safetensors weights (single file or sharded). Pickles are never loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fgchat.protocol.errors import ModelLoadError, is_out_of_memory
from fgchat.engine.model.resolve import INDEX_FILE, SINGLE_FILE
# Weight formats that need unpickling: refused, never opened (unpickling runs arbitrary code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A real safetensors header is a few MB at most; anything larger is garbage.
MAX_HEADER_BYTES = 100_000_000


def read_config(model_dir: Path) -> dict[str, Any]:
    """Parse `model_dir/config.json`; a missing or invalid file raises a one-line ModelLoadError."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"missing config.json in {model_dir}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"invalid {path}: {_one_line(e)}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"invalid {path}: expected a JSON object")
    return cfg


def load_safetensors(model_dir: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of the model in `model_dir`, keyed by their Hugging Face names, on `device`.

    Accepts `model.safetensors` or a shard set described by `model.safetensors.index.json`.
    Every file is validated (header parses, file is as long as the header says) before loading.
    """
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _load_file(file, device).items():
            if name in tensors:
                raise ModelLoadError(f"tensor '{name}' appears in more than one weights file in {model_dir}")
            tensors[name] = tensor
    _check_index_complete(model_dir, tensors)
    return tensors


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the model, in a stable order; refuses pickle-only dirs."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _shards_from_index(index)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ModelLoadError(_no_weights_message(model_dir))


def _no_weights_message(model_dir: Path) -> str:
    names = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        return (
            f"{model_dir} has only PyTorch pickle weights ({', '.join(pickles[:3])}); "
            "only safetensors and GGUF are supported (pickles are never loaded)"
        )
    ggufs = [n for n in names if n.endswith(".gguf")]
    if ggufs:
        return f"{model_dir} holds GGUF weights: pass the file itself, e.g. {model_dir / ggufs[0]}"
    return f"no weights file in {model_dir} (expected {SINGLE_FILE} or {INDEX_FILE})"


def _read_index(index: Path) -> dict[str, str]:
    """`weight_map` of a shard index: tensor name -> shard file name."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"invalid {index.name} in {index.parent}: {_one_line(e)}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(f"invalid {index.name} in {index.parent}: weight_map must map names to files")
    return weight_map


def _shards_from_index(index: Path) -> list[Path]:
    shards = []
    for name in sorted(set(_read_index(index).values())):
        shard = index.parent / name
        # Invariant: shard names stay inside the model directory (no "../" tricks).
        if Path(name).name != name or not shard.is_file():
            raise ModelLoadError(f"missing weights shard {name} listed in {index}")
        shards.append(shard)
    if not shards:
        raise ModelLoadError(f"{index} lists no weights shards")
    return shards


def _check_index_complete(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return
    missing = [name for name in _read_index(index) if name not in tensors]
    if missing:
        raise ModelLoadError(f"{INDEX_FILE} lists tensor '{missing[0]}' that no shard in {model_dir} holds")


def check_safetensors_file(path: Path) -> None:
    """Validate the header of a safetensors file and that the file holds all the data it declares."""
    corrupt = f"corrupt or truncated weights file {path.name}"
    size = path.stat().st_size
    if size < 8:
        raise ModelLoadError(f"{corrupt}: {size} bytes is too small for a header")
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ModelLoadError(f"{corrupt}: header length {header_len} does not fit in {size} bytes")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        data_end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise ModelLoadError(f"{corrupt}: header is not valid safetensors JSON") from None
    expected = 8 + header_len + data_end
    if size < expected:
        raise ModelLoadError(f"{corrupt}: {size} bytes on disk, header declares {expected}")


def _load_file(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    check_safetensors_file(path)
    try:
        return load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own SafetensorError for bad files
        if is_out_of_memory(e):
            raise  # not a file problem: the caller (loader.load_model) reports memory
        raise ModelLoadError(f"corrupt or truncated weights file {path.name}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
