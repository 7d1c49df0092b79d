"""A GGUF file of random weights (llama architecture, f16, bf16 or f32) of one of our presets' shapes,
for peers that read GGUF (llama.cpp: scripts/llama_cpp.sh bench). Weights are normal with std 0.02,
norm weights 1; tied embeddings write no output.weight; llama3/linear RoPE scaling is written as
llama.cpp's rope_freqs factors (from fgchat's own rope_inv_freq). The tokenizer is synthetic: an SPM
("llama") vocabulary of the preset's vocab size (byte tokens, <s>/</s>/<unk> at the preset's ids,
then made-up pieces), enough for llama.cpp to load the model and draw random token ids.

The file is written tensor by tensor: only the largest tensor is ever held in memory (1 GiB for the
8B preset's embeddings in bf16), never the whole model.

Usage: python tools/random_gguf.py PRESET [-o FILE] [--dtype bf16|f16|f32] [--seed 0]
       (PRESET: a name in fgchat/presets, or a path to a config.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402

from fgchat.engine.model.config import ModelConfig, parse_config, rope_inv_freq  # noqa: E402
from fgchat.presets import preset_names, preset_path  # noqa: E402

DTYPES = {"bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
          "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
          "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32)}
# numpy's dtype of a weight's elements in the file (bf16: its bits as uint16)
NP_DTYPES = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32}
CHUNK = 1 << 22  # elements drawn per generator call
STD = 0.02
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def load_config(preset: str) -> tuple[ModelConfig, dict]:
    """The parsed config (as fgchat parses it) and the raw JSON, by preset name or file path."""
    path = Path(preset)
    if not path.is_file():
        path = preset_path(preset)
    if not path.is_file():
        raise SystemExit(f"unknown preset {preset!r}; known presets: {', '.join(preset_names())}")
    raw = json.loads(path.read_text())
    cfg = parse_config(raw)
    if cfg.architecture != "LlamaForCausalLM" or cfg.qkv_bias:
        raise SystemExit(f"{preset}: {cfg.architecture} is not written as a llama GGUF (llama presets only)")
    return cfg, raw


def tensor_plan(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) for every tensor, in file order; kind: 'weight' (random, f16 or
    bf16), 'norm' (ones, f32) or 'rope_freqs' (f32). A numpy shape (rows, cols) is ggml's
    {cols, rows}: token_embd.weight is (vocab, hidden), i.e. {n_embd, n_vocab} in llama.cpp."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    plan = [("token_embd.weight", (cfg.vocab_size, h), "weight")]
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "norm"),
                 (b + "attn_q.weight", (q, h), "weight"),
                 (b + "attn_k.weight", (kv, h), "weight"),
                 (b + "attn_v.weight", (kv, h), "weight"),
                 (b + "attn_output.weight", (h, q), "weight"),
                 (b + "ffn_norm.weight", (h,), "norm"),
                 (b + "ffn_gate.weight", (f, h), "weight"),
                 (b + "ffn_up.weight", (f, h), "weight"),
                 (b + "ffn_down.weight", (h, f), "weight")]
    plan.append(("output_norm.weight", (h,), "norm"))
    if not cfg.tie_embeddings:
        plan.append(("output.weight", (cfg.vocab_size, h), "weight"))
    if cfg.rope_scaling:
        plan.append(("rope_freqs.weight", (cfg.head_dim // 2,), "rope_freqs"))
    return plan


def hparams(cfg: ModelConfig) -> list[tuple[str, int | float]]:
    """The llama.* keys llama.cpp's llama loader reads, as (GGUFWriter.add_<setter>, value):
    llama.vocab_size, .context_length, .embedding_length, .block_count, .feed_forward_length,
    .attention.head_count(_kv), .attention.key/value_length, .rope.dimension_count,
    .rope.freq_base, .attention.layer_norm_rms_epsilon."""
    return [("vocab_size", cfg.vocab_size), ("context_length", cfg.max_position),
            ("embedding_length", cfg.hidden_size), ("block_count", cfg.num_layers),
            ("feed_forward_length", cfg.intermediate_size), ("head_count", cfg.num_heads),
            ("head_count_kv", cfg.num_kv_heads), ("key_length", cfg.head_dim),
            ("value_length", cfg.head_dim), ("rope_dimension_count", cfg.head_dim),
            ("rope_freq_base", cfg.rope_theta), ("layer_norm_rms_eps", cfg.rms_eps)]


def rope_factors(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp divides each RoPE frequency by rope_freqs[i]: the unscaled inverse frequency over
    the scaled one, as fgchat computes them."""
    base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    scaled = rope_inv_freq(cfg)
    return np.array([b / s for b, s in zip(base, scaled)], dtype=np.float32)


def vocab(cfg: ModelConfig, raw: dict) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """Synthetic SPM vocabulary of cfg.vocab_size unique pieces: tokens, scores, token types and
    the special ids (bos, eos, unk) placed at the preset's ids."""
    n = cfg.vocab_size
    tokens: list[str | None] = [None] * n
    types = [NORMAL] * n
    special: dict[str, int] = {}
    bos = raw.get("bos_token_id")
    eos = cfg.eos_ids[0] if cfg.eos_ids else None
    for name, tid, text in (("bos", bos, "<s>"), ("eos", eos, "</s>")):
        if isinstance(tid, int) and 0 <= tid < n and tokens[tid] is None:
            tokens[tid], types[tid], special[name] = text, CONTROL, tid
    free = (i for i in range(n) if tokens[i] is None)
    if n - len(special) >= 1 + 256:  # <unk> and the 256 byte pieces SPM falls back to
        special["unk"] = next(free)
        tokens[special["unk"]], types[special["unk"]] = "<unk>", UNKNOWN
        for byte in range(256):
            i = next(free)
            tokens[i], types[i] = f"<0x{byte:02X}>", BYTE
    for i in range(n):
        if tokens[i] is None:
            tokens[i] = f"\u2581t{i}"
    scores = [0.0 if types[i] != NORMAL else -float(i) for i in range(n)]
    return tokens, scores, types, special  # type: ignore[return-value]


def _fill(out: np.ndarray, kind: str, seed: int, index: int, std: float) -> None:
    """Random normal(0, std) values into out (float32, float16 or bf16 bits as uint16), chunk by chunk;
    chunk c of tensor index draws from its own generator, so the values do not depend on the
    number of threads."""
    flat = out.reshape(-1)
    starts = range(0, flat.size, CHUNK)

    def one(c: int) -> None:
        lo = starts[c]
        hi = min(lo + CHUNK, flat.size)
        x = np.random.default_rng([seed, index, c]).standard_normal(hi - lo, dtype=np.float32)
        x *= std
        if kind in ("f16", "f32"):
            flat[lo:hi] = x
        else:  # bf16: round to nearest even on the float32 bits (normal samples are finite)
            u = x.view(np.uint32)
            u += 0x7FFF + ((u >> 16) & 1)
            flat[lo:hi] = u >> 16

    threads = min(8, os.cpu_count() or 1, len(starts))
    if threads <= 1:
        for c in range(len(starts)):
            one(c)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(starts))))


def write(preset: str, path: str | Path, dtype: str = "bf16", seed: int = 0, std: float = STD,
          quiet: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """Write the GGUF; returns the tensor plan it wrote."""
    if dtype not in DTYPES:
        raise SystemExit(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    cfg, raw = load_config(preset)
    qtype, ftype = DTYPES[dtype]
    name = Path(preset).stem if Path(preset).is_file() else preset
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"{name} (random weights, {dtype})")
    w.add_file_type(ftype)
    for setter, value in hparams(cfg):
        getattr(w, f"add_{setter}")(value)
    tokens, scores, types, special = vocab(cfg, raw)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, tid in special.items():
        getattr(w, f"add_{key}_token_id")(tid)
    w.add_add_bos_token(False)

    plan = tensor_plan(cfg)
    for tname, shape, kind in plan:
        count = int(np.prod(shape))
        if kind == "weight":
            np_dtype = np.dtype(NP_DTYPES[dtype])
            w.add_tensor_info(tname, shape, np_dtype, count * np_dtype.itemsize,
                              raw_dtype=qtype if dtype == "bf16" else None)
        else:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), count * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for index, (tname, shape, kind) in enumerate(plan):
        if kind == "norm":
            data = np.ones(shape, dtype=np.float32)
        elif kind == "rope_freqs":
            data = rope_factors(cfg)
        else:
            data = np.empty(shape, dtype=NP_DTYPES[dtype])
            _fill(data, dtype, seed, index, std)
        w.write_tensor_data(data)
        del data
    w.close()
    if not quiet:
        size = Path(path).stat().st_size
        print(f"{path}: {name} {dtype}, {len(plan)} tensors, {size / 2**20:.1f} MiB "
              f"in {time.perf_counter() - t0:.1f} s")
    return plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", help="preset name (fgchat/presets) or path to a config.json")
    ap.add_argument("-o", "--output", help="GGUF path (default: /tmp/<preset>-<dtype>.gguf)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = args.output or f"/tmp/{Path(args.preset).stem}-{args.dtype}.gguf"
    write(args.preset, out, args.dtype, args.seed)


if __name__ == "__main__":
    main()
