"""A GGUF file of random weights (f16, bf16 or f32) of one of our presets' shapes, in llama.cpp's
llama, qwen3 or gemma3 architecture, for peers that read GGUF (llama.cpp: scripts/llama_cpp.sh bench).
Weights are normal with std 0.02, norm weights 1 (Gemma's too: its RMSNorm scales by 1 + w and
llama.cpp's converter stores 1 + w, so 1 is w = 0); tied embeddings write no output.weight.
llama: llama3/linear RoPE scaling is written as llama.cpp's rope_freqs factors (from fgchat's own
rope_inv_freq). qwen3: q/k norms per layer. gemma3: q/k norms, post-attention and post-FFN norms,
the sliding window with its per-layer pattern and the local layers' RoPE base, linear RoPE scaling of
the global layers, the final logit softcap; llama.cpp scales the embeddings by sqrt(hidden) itself
and takes the query scale from head_dim (a warning says where query_pre_attn_scalar differs).
The tokenizer is synthetic: an SPM ("llama") vocabulary of the preset's vocab size (byte tokens,
<s>/</s>/<unk> at the preset's ids, then made-up pieces), enough for llama.cpp to load the model
(any of the three architectures) and draw random token ids.

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
from typing import Any

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
# the Hugging Face architectures written, with llama.cpp's name for each (general.architecture, the
# prefix of its keys)
ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def preset_label(preset: str) -> str:
    """A preset's name in file names: the name itself; for a config.json path its stem, or its
    folder's name where the file is config.json (scripts/llama_cpp.sh names it the same way)."""
    path = Path(preset)
    if not path.is_file():
        return preset
    return path.parent.name if path.stem == "config" and path.parent.name else path.stem


def load_config(preset: str) -> tuple[ModelConfig, dict]:
    """The parsed config (as fgchat parses it) and the raw JSON, by preset name or file path."""
    path = Path(preset)
    if not path.is_file():
        path = preset_path(preset)
    if not path.is_file():
        raise SystemExit(f"unknown preset {preset!r}; known presets: {', '.join(preset_names())}")
    raw = json.loads(path.read_text())
    cfg = parse_config(raw)
    why = ("" if cfg.architecture not in ARCHS else " with qkv bias" if cfg.qkv_bias
           else " with a sliding window on every layer" if cfg.sliding_window else None)
    if why is not None:
        raise SystemExit(f"{preset}: {cfg.architecture}{why} is not written as a GGUF "
                         f"(supported: {', '.join(ARCHS)}, no qkv bias)")
    if cfg.rope_scaling and ARCHS[cfg.architecture] != "llama" and _scaling_kind(cfg) != "linear":
        raise SystemExit(f"{preset}: {_scaling_kind(cfg)} RoPE scaling is written for llama presets only")
    return cfg, raw


def _scaling_kind(cfg: ModelConfig) -> str | None:
    sc = cfg.rope_scaling
    return sc.get("rope_type", sc.get("type")) if sc else None


def tensor_plan(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) for every tensor, in file order; kind: 'weight' (random, f16 or
    bf16), 'norm' (ones, f32) or 'rope_freqs' (f32). A numpy shape (rows, cols) is ggml's
    {cols, rows}: token_embd.weight is (vocab, hidden), i.e. {n_embd, n_vocab} in llama.cpp.
    Per layer: llama's nine tensors; qwen3 and gemma3 add attn_q_norm / attn_k_norm {head_dim},
    gemma3 post_attention_norm and post_ffw_norm {n_embd} after the attention and the FFN."""
    h, f, q, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    gemma = ARCHS[cfg.architecture] == "gemma3"
    plan = [("token_embd.weight", (cfg.vocab_size, h), "weight")]
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "norm"),
                 (b + "attn_q.weight", (q, h), "weight"),
                 (b + "attn_k.weight", (kv, h), "weight"),
                 (b + "attn_v.weight", (kv, h), "weight"),
                 (b + "attn_output.weight", (h, q), "weight")]
        if cfg.qk_norm:
            plan += [(b + "attn_q_norm.weight", (d,), "norm"), (b + "attn_k_norm.weight", (d,), "norm")]
        if gemma:
            plan.append((b + "post_attention_norm.weight", (h,), "norm"))
        plan += [(b + "ffn_norm.weight", (h,), "norm"),
                 (b + "ffn_gate.weight", (f, h), "weight"),
                 (b + "ffn_up.weight", (f, h), "weight"),
                 (b + "ffn_down.weight", (h, f), "weight")]
        if gemma:
            plan.append((b + "post_ffw_norm.weight", (h,), "norm"))
    plan.append(("output_norm.weight", (h,), "norm"))
    if not cfg.tie_embeddings:
        plan.append(("output.weight", (cfg.vocab_size, h), "weight"))
    if cfg.rope_scaling and ARCHS[cfg.architecture] == "llama":
        plan.append(("rope_freqs.weight", (cfg.head_dim // 2,), "rope_freqs"))
    return plan


def hparams(cfg: ModelConfig) -> list[tuple[str, Any]]:
    """The ARCH.* keys llama.cpp's loader reads, as (GGUFWriter.add_<setter>, value):
    ARCH.vocab_size, .context_length, .embedding_length, .block_count, .feed_forward_length,
    .attention.head_count(_kv), .attention.key/value_length, .rope.dimension_count,
    .rope.freq_base, .attention.layer_norm_rms_epsilon; linear RoPE scaling outside llama as
    .rope.scaling.type / .factor; gemma3's .attention.sliding_window, .sliding_window_pattern (per
    layer, true: windowed), .rope.freq_base_swa and .final_logit_softcapping where set."""
    keys: list[tuple[str, Any]] = [
        ("vocab_size", cfg.vocab_size), ("context_length", cfg.max_position),
        ("embedding_length", cfg.hidden_size), ("block_count", cfg.num_layers),
        ("feed_forward_length", cfg.intermediate_size), ("head_count", cfg.num_heads),
        ("head_count_kv", cfg.num_kv_heads), ("key_length", cfg.head_dim),
        ("value_length", cfg.head_dim), ("rope_dimension_count", cfg.head_dim),
        ("rope_freq_base", cfg.rope_theta), ("layer_norm_rms_eps", cfg.rms_eps)]
    arch = ARCHS[cfg.architecture]
    if cfg.rope_scaling and arch != "llama":  # linear (load_config): llama.cpp divides positions by it
        keys += [("rope_scaling_type", gguf.RopeScalingType.LINEAR),
                 ("rope_scaling_factor", float(cfg.rope_scaling["factor"]))]
    if arch != "gemma3":
        return keys
    windows = sorted({w for w in cfg.layer_windows if w})
    if len(windows) > 1:
        raise SystemExit(f"sliding windows of several sizes ({windows}): llama.cpp has one per model")
    if windows:
        keys += [("sliding_window", windows[0]),
                 ("sliding_window_pattern", [bool(w) for w in cfg.layer_windows]),
                 ("rope_freq_base_swa", cfg.local_rope_theta or 10000.0)]
    if cfg.final_softcap:
        keys.append(("final_logit_softcapping", cfg.final_softcap))
    return keys


def llama_cpp_query_scale(cfg: ModelConfig) -> float:
    """The query scale llama.cpp's gemma3 graph applies: 1/sqrt(head_dim), but 1/sqrt(hidden/heads)
    for the 62-layer (27B) model; it reads no query_pre_attn_scalar."""
    if cfg.num_layers == 62:
        return (cfg.hidden_size / cfg.num_heads) ** -0.5
    return cfg.head_dim ** -0.5


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
    name = preset_label(preset)
    arch = ARCHS[cfg.architecture]
    if cfg.attn_scale is not None and abs(cfg.attn_scale / llama_cpp_query_scale(cfg) - 1) > 1e-6:
        print(f"warning: {name}: llama.cpp scales queries by {llama_cpp_query_scale(cfg):.6g}, the preset by "
              f"{cfg.attn_scale:.6g} (query_pre_attn_scalar): same cost, other values", file=sys.stderr)
    w = gguf.GGUFWriter(str(path), arch)
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
        print(f"{path}: {name} {arch} {dtype}, {len(plan)} tensors, {size / 2**20:.1f} MiB "
              f"in {time.perf_counter() - t0:.1f} s")
    return plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", help="preset name (fgchat/presets) or path to a config.json")
    ap.add_argument("-o", "--output", help="GGUF path (default: /tmp/<preset>-<dtype>.gguf)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = args.output or f"/tmp/{preset_label(args.preset)}-{args.dtype}.gguf"
    write(args.preset, out, args.dtype, args.seed)


if __name__ == "__main__":
    main()
