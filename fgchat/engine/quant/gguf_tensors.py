"""A GGUF file's tensors read raw (quant.gguf_index): the block formats we keep (qweight.GGUF_FORMATS) as QuantWeight
planes, float tensors as plain tensors, under our Hugging Face names.

Invariants:
- A plane holds the bytes of its field in every block, unchanged; only Q4_K / Q5_K's 12 packed
  scale bytes are unpacked into the 6-bit sc and mn values they hold (qweight's layout).
- llama.cpp's converter permutes the q and k rows of "llama" architecture files (Llama, Mistral,
  SmolLM2; rotary pairs interleaved); those rows (and their biases) are permuted back here, as
  transformers' GGUF loader does, so row r is row r of the Hugging Face weight. Rows are
  independent in every format, so permuting plane rows permutes the weight's rows.
- Tensors of other types (IQ*, Q2_K, Q3_K, Q5_0, Q5_1, ...) come back dequantized to float32 by
  gguf-py and are named in `other_types`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fgchat.engine.quant.gguf_index import GgufTensorInfo, read_index
from fgchat.engine.quant.qweight import BLOCK, GGUF_FORMATS, QuantWeight

# per format: bytes per block, then each field's (plane, first byte, end byte, dtype) in a block
BLOCK_FIELDS: dict[str, tuple[int, list[tuple[str, int, int, torch.dtype]]]] = {
    "Q8_0": (34, [("d", 0, 2, torch.float16), ("qs", 2, 34, torch.int8)]),
    "Q4_0": (18, [("d", 0, 2, torch.float16), ("qs", 2, 18, torch.uint8)]),
    "Q4_1": (20, [("d", 0, 2, torch.float16), ("m", 2, 4, torch.float16), ("qs", 4, 20, torch.uint8)]),
    "Q4_K": (144, [("d", 0, 2, torch.float16), ("dmin", 2, 4, torch.float16), ("scales", 4, 16, torch.uint8),
                   ("qs", 16, 144, torch.uint8)]),
    "Q5_K": (176, [("d", 0, 2, torch.float16), ("dmin", 2, 4, torch.float16), ("scales", 4, 16, torch.uint8),
                   ("qh", 16, 48, torch.uint8), ("qs", 48, 176, torch.uint8)]),
    "Q6_K": (210, [("ql", 0, 128, torch.uint8), ("qh", 128, 192, torch.uint8), ("sc", 192, 208, torch.int8),
                   ("d", 208, 210, torch.float16)]),
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")
# architectures whose q / k rows llama.cpp's converter permuted (transformers' LlamaTensorProcessor)
PERMUTED_ARCHITECTURES = ("llama",)
# GGUF architectures whose every decoder tensor hf_name names, with the values transformers' GGUF
# loader gives (nothing but the q / k permutation above): the loader builds them from the file alone
# ("llama": Llama, Mistral, SmolLM2; "qwen2": with q / k / v biases)
OWN_WEIGHT_ARCHITECTURES = ("llama", "qwen2")


def hf_name(gguf_name: str) -> str | None:
    """Our (Hugging Face) name of a GGUF tensor; None for tensors the decoder does not use."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        role = _LAYER_NAMES.get(m[2])
        return None if role is None else f"model.layers.{m[1]}.{role}.{m[3]}"
    m = _TOP_RE.match(gguf_name)
    if m and m[1] in _TOP_NAMES:
        return f"{_TOP_NAMES[m[1]]}.{m[2]}"
    return None


def _unpack_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: a block's 12 scale bytes [..., 12] -> its 8 sub-block scales and mins, each
    6 bits: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7
    take their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their high 2
    bits from the top bits of bytes 0-3 (scales) and 4-7 (mins). Computed on the 12 bytes as three
    little-endian 32-bit words, four sub-blocks a word (every mask keeps bits inside their byte)."""
    w = scales.contiguous().numpy().view("<u4")  # numpy: ~20x torch's CPU speed on these strided words
    a, b, c = w[..., 0], w[..., 1], w[..., 2]
    low6, top2, low4 = np.uint32(0x3F3F3F3F), np.uint32(0x30303030), np.uint32(0x0F0F0F0F)
    sc = np.stack((a & low6, (c & low4) | ((a >> 2) & top2)), axis=-1)
    mn = np.stack((b & low6, ((c >> 4) & low4) | ((b >> 2) & top2)), axis=-1)
    return torch.from_numpy(sc.view(np.uint8)), torch.from_numpy(mn.view(np.uint8))


def planes_from_blocks(fmt: str, raw: torch.Tensor, k: int) -> QuantWeight:
    """The planes of a weight [N, K] in block format `fmt` from its bytes raw uint8 [N, bytes per row] (CPU)."""
    size, fields = BLOCK_FIELDS[fmt]
    n, nb = raw.shape[0], k // BLOCK[fmt]
    if k % BLOCK[fmt] or raw.shape[1] != nb * size:
        raise ValueError(f"{fmt}: {raw.shape[1]} bytes per row do not hold {k} weights")
    blocks = raw.numpy().reshape(n, nb, size)  # numpy gathers strided bytes far faster than torch on CPU
    planes: dict[str, torch.Tensor] = {}
    for name, a, b, dtype in fields:
        planes[name] = torch.from_numpy(np.ascontiguousarray(blocks[:, :, a:b])).view(dtype).reshape(n, -1)
    if "scales" in planes:
        sc, mn = _unpack_k_scales(planes.pop("scales").view(n, nb, 12))
        planes["sc"], planes["mn"] = sc.reshape(n, -1), mn.reshape(n, -1)
    return QuantWeight(fmt, (n, k), planes)


def unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row r of the Hugging Face weight is row index[r] of llama.cpp's permuted one: within each
    head, llama.cpp stores rotary pair halves interleaved (row 2i + s is HF row s * half + i)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _permute_rows(t: torch.Tensor | QuantWeight, index: torch.Tensor) -> torch.Tensor | QuantWeight:
    if isinstance(t, torch.Tensor):
        return t[index].contiguous()
    return QuantWeight(t.fmt, t.shape, {k: p[index].contiguous() for k, p in t.planes.items()})


@dataclass
class GgufWeights:
    """A GGUF file's decoder tensors under our names: QuantWeight for the kept block formats, plain
    tensors for float types and for the rest (dequantized to float32)."""

    architecture: str
    tensors: dict[str, torch.Tensor | QuantWeight]
    # GGUF type name -> how many decoder tensors of that type were dequantized (not kept as they are)
    other_types: dict[str, int] = field(default_factory=dict)

    def formats(self) -> list[str]:
        """The block formats kept, in the order of qweight.GGUF_FORMATS."""
        kept = {t.fmt for t in self.tensors.values() if isinstance(t, QuantWeight)}
        return [f for f in GGUF_FORMATS if f in kept]


def _tensor(t: GgufTensorInfo) -> tuple[torch.Tensor | QuantWeight, str | None]:
    """One indexed tensor as planes or a plain tensor [rows, K] (or [K]); the type name when it
    was dequantized."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.type_id)
    kind, k = qtype.name, t.dims[0]  # GGUF lists dims innermost first
    rows = int(np.prod(t.dims[1:], dtype=np.int64))
    data = np.array(t.data).reshape(rows, -1)  # a copy: the index maps the file read-only
    shape = tuple(reversed(t.dims))
    if kind in GGUF_FORMATS and len(t.dims) == 2:
        return planes_from_blocks(kind, torch.from_numpy(data), k), None
    if kind in FLOAT_TYPES:
        dtype = FLOAT_TYPES[kind]
        return torch.from_numpy(data).view(dtype).reshape(shape), None
    values = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape), kind


def read_gguf_weights(path: Path, num_heads: int, num_kv_heads: int) -> GgufWeights:
    """The decoder tensors of the GGUF file at `path` (see the module invariants). num_heads /
    num_kv_heads: the model's attention heads (they size the q / k row permutation)."""
    index = read_index(path)
    arch = index.architecture
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    other: dict[str, int] = {}
    for t in index.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        value, dequantized = _tensor(t)
        if dequantized is not None:
            other[dequantized] = other.get(dequantized, 0) + 1
        if arch in PERMUTED_ARCHITECTURES and (".q_proj." in name or ".k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            value = _permute_rows(value, unpermute_index(value.shape[0], heads))
        tensors[name] = value
    return GgufWeights(arch, tensors, other)
