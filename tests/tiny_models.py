"""Builds tiny random-weight models in Hugging Face format (config, safetensors, tokenizer).

Used by tests to exercise the real loading path without a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

# tiny models ship the ChatML template that fgchat also falls back to
from fgchat.engine.model.tokenizer import CHATML_TEMPLATE

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello there! How are you today? I am fine, thank you.",
    "Latency, throughput and CUDA graphs: decode steps launch many small kernels.",
    "Ünïcödé text — naïve café, 東京, emoji 🙂 and more bytes.",
    "def f(x):\n    return x * 2  # numbers 0123456789",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(out: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE tokenizer; writes tokenizer.json + tokenizer_config.json. Returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return tok.get_vocab_size()


FAMILIES = ("llama", "qwen2", "mistral")
# the families of model.families: built by the tests that need them (not by the session fixture)
NEW_FAMILIES = ("qwen3", "gemma3", "phi3")
# the tiny Gemma 3's window (its layers 0 and 2 are windowed) and Phi-3's original context (LongRoPE)
GEMMA_WINDOW = 8
PHI3_ORIGINAL_CONTEXT = 32


def build_model(
    out: Path,
    family: str = "llama",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 128,
    tie: bool = False,
    rope_scaling: dict | None = None,
    max_pos: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    softcap: float | None = 30.0,
) -> Path:
    """Save a tiny random model of `family` with a trained tokenizer into `out` (gemma3: its final
    logit softcap, None for none as Gemma 3's own configs)."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if family == "llama":
        if rope_scaling is None:
            cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        elif int(transformers.__version__.split(".")[0]) >= 5:
            cfg = transformers.LlamaConfig(
                **common, rope_parameters={"rope_theta": 10000.0, **rope_scaling}
            )
        else:
            cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        cls = transformers.Qwen2ForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralForCausalLM
    elif family == "qwen3":
        common.setdefault("head_dim", 2 * hidden // heads)  # q / o wider than hidden, as Qwen3-0.6B
        cfg = transformers.Qwen3Config(**common, rope_theta=1000000.0)
        cls = transformers.Qwen3ForCausalLM
    elif family == "gemma3":
        common.setdefault("head_dim", hidden // heads)
        types = ["full_attention" if i % 3 == 1 else "sliding_attention" for i in range(layers)]
        cfg = transformers.Gemma3TextConfig(
            **common, sliding_window=GEMMA_WINDOW, layer_types=types, query_pre_attn_scalar=24,
            final_logit_softcapping=softcap, pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        cls = transformers.Gemma3ForCausalLM
    elif family == "phi3":
        rot = (head_dim or hidden // heads) // 2
        scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rot // 2)],
                   "long_factor": [2.0 + 0.5 * i for i in range(rot // 2)], "rope_theta": 10000.0,
                   "partial_rotary_factor": 0.5, "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT}
        cfg = transformers.Phi3Config(**common, rope_parameters=scaling, partial_rotary_factor=0.5,
                                      original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
                                      pad_token_id=ids["<|endoftext|>"], sliding_window=None)
        cls = transformers.Phi3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init so logits are not all ties
            p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w
                p.uniform_(-0.2, 0.2) if family == "gemma3" else p.uniform_(0.8, 1.2)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return out


def head64_model(out: Path, max_pos: int = 8192, seed: int = 9) -> Path:
    """The GPU tests' small Llama with a real model's head shape: head dim 64 (the Triton
    attention's), 8 query and 2 KV heads, hidden 512, 3 layers."""
    return build_model(out, "llama", hidden=512, layers=3, heads=8, kv_heads=2, head_dim=64,
                       intermediate=1024, max_pos=max_pos, seed=seed)


def file_weight_bytes(model_dir: Path, dtype) -> tuple[int, int]:
    """(every weight, all but the embedding table) of a saved model, in bytes of `dtype`: what
    the engine holds and what a decode step reads, counted from the file's tensor shapes."""
    import math

    import torch
    from safetensors import safe_open

    size = torch.empty(0, dtype=dtype).element_size()
    total = embed = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            count = math.prod(f.get_slice(name).get_shape())
            total += count
            embed += count if name == "model.embed_tokens.weight" else 0
    return total * size, (total - embed) * size


def hf_greedy(model_dir: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt (new tokens, no stop)."""
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            seq = ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out
