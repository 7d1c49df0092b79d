"""What a benchmark run measures (BenchSpec), its shared prompts and its statistics; used by our
runner and by the peer runners alike."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fgchat.metrics.stats import summarize
from fgchat.protocol.events import Mode


@dataclass
class BenchSpec:
    model: str | None = None
    preset: str | None = None
    modes: list[str] = field(default_factory=lambda: [str(m) for m in Mode])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prompt_len: int = 512
    # "random": random token prompts of prompt_len, each generating output_len tokens; else a chat
    # prompt set (bench.prompt_sets: a built-in name or a file) whose requests stop at end of sequence
    prompts: str = "random"
    output_len: int = 128
    warmup: int = 1
    repeats: int = 3
    peers: list[str] = field(default_factory=list)
    peer_timeout: float = 420.0  # seconds per peer, checked between generate calls
    attention: str = "auto"
    device: str | None = None
    dtype: str | None = None
    max_context: int | None = None
    progress: bool = True
    outliers: float = 0.0  # random weights: massive activation channels (decoder.random_weights)
    # greedy with repetition / presence / frequency penalties (the PENALIZED step variant)
    penalties: bool = False
    # sampled steps (the SAMPLED variant; with top_k > 0 SAMPLED_FILTERED, which sorts the logits);
    # temperature 0: greedy. Request i of a round samples with seed i.
    temperature: float = 0.0
    top_k: int = 0
    # weight sets measured one after the other, one engine each: --quantize values ("none": the
    # model's own weights); dequantize: a GGUF file's weights dequantized at load
    quantize: list[str] = field(default_factory=lambda: ["none"])
    dequantize: bool = False
    # speculation methods measured in every mode ("off": the plain rows; others: rows "full+ngram"
    # ...); oracle drafts are each prompt's own greedy continuation from a plain run first
    speculate: list[str] = field(default_factory=lambda: ["off"])
    draft: str | None = None  # the draft model of "draft"
    draft_len: int = 4


def stats(values: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 of the finite values (serving-benchmark key names); None when empty."""
    s = summarize(values)
    return {"mean": s.mean, "median": s.p50, "p90": s.p90, "p99": s.p99}


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Same random prompts for every runner at a given batch size."""
    g = torch.Generator().manual_seed(1000 + batch)
    return torch.randint(10, vocab, (batch, prompt_len), generator=g).tolist()
