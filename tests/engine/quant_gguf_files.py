"""Test helpers: GGUF block bytes of every kept format (gguf-py's quantizer where it has one,
else random bytes with sane fp16 scales) and small GGUF files written with gguf-py's writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# per random-bytes format: bytes per block and the byte offsets of its fp16 scales
# GGUF projection names and their Hugging Face modules
HF_ROLES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
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


def llama_blocks_gguf(model_dir: Path, out: Path, kinds: dict[str, str], embed: str | None,
                      seed: int) -> tuple[dict[str, tuple[np.ndarray, str]], object]:
    """A "llama" GGUF of model_dir's shapes: every layer's projection g (HF_ROLES) as random
    blocks of kinds[g] (llama.cpp's q / k row order), the token embedding as `embed` blocks (None:
    not written); the rest comes from model_dir when it is resolved as the file's conversion.
    Returns (the raw tensors by GGUF name, the model's config)."""
    from fgchat.engine.model.config import parse_config
    from fgchat.engine.model.weights import load_safetensors, read_config

    cfg = parse_config(read_config(model_dir))
    sd = load_safetensors(model_dir)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for g, kind in kinds.items():
            n, k = sd[f"model.layers.{i}.{HF_ROLES[g]}.weight"].shape
            raw = block_bytes(kind, n, k, rng)
            if g in ("attn_q", "attn_k"):
                raw = llama_cpp_permute(raw, cfg.num_heads if g == "attn_q" else cfg.num_kv_heads)
            tensors[f"blk.{i}.{g}.weight"] = (raw, kind)
    if embed is not None:
        tensors["token_embd.weight"] = (block_bytes(embed, cfg.vocab_size, cfg.hidden_size, rng), embed)
    write_gguf(out, "llama", tensors)
    return tensors, cfg
