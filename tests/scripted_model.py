"""A tiny Llama whose greedy replies are known in advance, with a word-level tokenizer and a
ChatML-like chat template that rejects roles out of order, so EOS, the generation prompt, the
system prompt and the roles all change what the engine produces.

The weights are written by hand (one layer, float32, hidden HIDDEN):
- the embedding puts token t on residual dim t (value 1); attention's o_proj and the MLP's
  down_proj write only the two extra dims P and Q, so the LM head sees the current token's dim
  (scaled by the final RMSNorm to sqrt(HIDDEN)) and its rows are a next-token table: the greedy
  token after t is NEXT[t] (logit 10, every other logit 0), except as below;
- attention has zero queries and keys, so every position attends uniformly to all positions up to
  it; its value reads the "pirate" dim, so dim P holds the share of "pirate" tokens so far;
- the MLP gates P by the "assistant" dim (SiLU(0) is 0: exactly nothing elsewhere) into dim Q, and
  the LM head maps Q to "arr" (logit up to 30): at the generation prompt's "assistant", a context
  that says "pirate" anywhere (a system prompt, say) replies "arr matey", any other "hello world".

So with add_generation_prompt the last prompt token is "assistant" and a chat's greedy reply is
"hello world" then <|im_end|> (or "arr matey" then <|im_end|>); a prompt without it ends on
<|im_end|>, whose next token is "wrong" (which repeats forever). Where <|im_end|> is declared as
EOS is chosen per build (`eos_in`): a model that stops there only if that declaration is read.
With enable_thinking true the template ends the generation prompt on "ponder", and the reply
opens with a think block: "<think> hmm </think> hello world" (THINK_REPLY).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = range(3)
WORDS = [
    "[UNK]", "system", "user", "assistant", "developer", "you", "are", "a", "pirate", "hi", "tell", "me",
    "hello", "world", "arr", "matey", "wrong", "count", "one", "two", "three", "four", "five", "six",
    "seven", "eight", "echo", "done", "mute", ".", "!", "?", "ponder", "hmm",
]
THINK_TAGS = ["<think>", "</think>"]  # added tokens (kept whole, not special: decoded as text)
WORDS += THINK_TAGS
VOCAB = SPECIAL + WORDS
ID = {w: i for i, w in enumerate(VOCAB)}
HIDDEN = 64
DIM_P = len(VOCAB)  # share of "pirate" tokens among the positions attended to
DIM_Q = DIM_P + 1  # "pirate" seen, at an "assistant" position
LOGIT = 10.0
ARR_LOGIT = 30.0

# greedy chains: the next token of each token (every other token is followed by "wrong")
CHAINS = [
    ["assistant", "hello", "world", "<|im_end|>"],
    ["arr", "matey", "<|im_end|>"],
    ["<|im_end|>", "wrong"],
    ["count", "one", "two", "three", "four", "five", "six", "seven", "eight", "<|im_end|>"],
    ["done", "<|im_end|>"],
    ["mute", "<|im_end|>"],
    ["ponder", "<think>", "hmm", "</think>", "hello"],
]
NEXT = {a: b for chain in CHAINS for a, b in zip(chain, chain[1:])}
# "echo" prefers itself (10) to "done" (9): a repetition, presence or frequency penalty of this
# size turns "echo echo echo ..." into "done" / "echo done"
ECHO_SELF, ECHO_DONE = 10.0, 9.0

REPLY = ["hello", "world", "<|im_end|>"]
PIRATE_REPLY = ["arr", "matey", "<|im_end|>"]
THINK_REPLY = ["<think>", "hmm", "</think>", "hello", "world", "<|im_end|>"]
COUNT = ["one", "two", "three", "four", "five", "six", "seven", "eight", "<|im_end|>"]

# ChatML, but strict as Mistral's or Gemma's templates are: an optional system message first, then
# user and assistant turns alternating from a user turn; anything else is refused
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{ 'ponder\n' }}{%- endif -%}{%- endif -%}"
)

EOS_PLACES = ("config", "generation_config", "tokenizer")


def chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """What CHAT_TEMPLATE renders for well-ordered messages, written out independently of it."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def backend() -> Tokenizer:
    """The word-level `tokenizers.Tokenizer` (special tokens split out before the words)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in THINK_TAGS])
    return tok


def encode(text: str) -> list[int]:
    """Ids of `text` by the tokenizer itself (not through fgchat)."""
    return list(backend().encode(text).ids)


def _weights(torch: Any) -> dict[str, Any]:
    """name -> tensor, as LlamaForCausalLM names them (one layer, 4 heads of 16, 2 KV heads)."""
    h, v, inter, hd = HIDDEN, len(VOCAB), 16, 16
    root = math.sqrt(h)
    w = {
        "model.embed_tokens.weight": torch.zeros(v, h),
        "model.norm.weight": torch.ones(h),
        "model.layers.0.input_layernorm.weight": torch.ones(h),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(h),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(4 * hd, h),
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(2 * hd, h),
        "model.layers.0.self_attn.v_proj.weight": torch.zeros(2 * hd, h),
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(h, 4 * hd),
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(inter, h),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(inter, h),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(h, inter),
        "lm_head.weight": torch.zeros(v, h),
    }
    w["model.embed_tokens.weight"][:, :v] = torch.eye(v)
    # attention: value channel 0 of KV head 0 = sqrt(h) [token is pirate] / sqrt(h); query head 0
    # reads it, o_proj writes the mean over the positions to dim P
    w["model.layers.0.self_attn.v_proj.weight"][0, ID["pirate"]] = 1.0 / root
    w["model.layers.0.self_attn.o_proj.weight"][DIM_P, 0] = 1.0
    # MLP: SiLU(sqrt(h) [token is assistant]) * 16 sqrt(h) P, to dim Q: about 1024 P, which outweighs
    # "hello" for one "pirate" in up to ~2500 positions
    w["model.layers.0.mlp.gate_proj.weight"][0, ID["assistant"]] = 1.0
    w["model.layers.0.mlp.up_proj.weight"][0, DIM_P] = 16.0
    w["model.layers.0.mlp.down_proj.weight"][DIM_Q, 0] = 1.0
    head = w["lm_head.weight"]
    for t in range(v):
        head[ID[NEXT.get(VOCAB[t], "wrong")], t] = LOGIT / root
    head[:, ID["echo"]] = 0.0
    head[ID["echo"], ID["echo"]] = ECHO_SELF / root
    head[ID["done"], ID["echo"]] = ECHO_DONE / root
    head[ID["arr"], DIM_Q] = ARR_LOGIT / root
    return w


def build_scripted_model(out: Path, eos_in: str = "generation_config") -> Path:
    """Save the model into `out`; <|im_end|> (where every reply ends) is declared as EOS only in
    `eos_in` (one of EOS_PLACES); the other places name <|endoftext|>, which no reply emits."""
    import torch
    from safetensors.torch import save_file

    if eos_in not in EOS_PLACES:
        raise ValueError(eos_in)
    out.mkdir(parents=True, exist_ok=True)
    backend().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIAL[IM_END] if eos_in == "tokenizer" else SPECIAL[ENDOFTEXT],
        "pad_token": SPECIAL[ENDOFTEXT],
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }, indent=1))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(VOCAB),
        "hidden_size": HIDDEN,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END if eos_in == "config" else ENDOFTEXT,
    }, indent=1))
    if eos_in == "generation_config":  # the list form (Llama 3, Qwen), as transformers writes it
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ENDOFTEXT, "eos_token_id": [ENDOFTEXT, IM_END]}, indent=1))
    save_file({k: t.contiguous() for k, t in _weights(torch).items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
