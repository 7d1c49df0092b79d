"""Test helpers: GGUF block bytes of every kept format (gguf-py's quantizer where it has one,
else random bytes with sane fp16 scales) and small GGUF files written with gguf-py's writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# per random-bytes format: bytes per block and the byte offsets of its fp16 scales
RANDOM_LAYOUT = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)),
                 "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,))}


def block_bytes(fmt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of a `fmt` weight [rows, k]."""
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt in QUANTIZABLE:
        w = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
        return gguf.quants.quantize(w, qtype)
    size, scale_at = RANDOM_LAYOUT[fmt]
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    for at in scale_at:  # finite, small fp16 scales (random bytes could be inf / NaN)
        scale = (rng.standard_normal((rows, k // 256)) * 1e-3).astype(np.float16)
        raw[:, :, at: at + 2] = scale.view(np.uint8).reshape(rows, k // 256, 2)
    return raw.reshape(rows, -1)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k row order (its LlamaModel.permute) of HF rows w [N, ...]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF file with metadata general.architecture and `tensors`: GGUF name -> (data, type
    name); data is block bytes [rows, bytes per row] for block types, the values for F32 / F16."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    for name, (data, kind) in tensors.items():
        if kind in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:  # the writer takes the logical shape from the byte shape
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
