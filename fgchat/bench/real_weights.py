"""fgchat on real weights against transformers and against float32 (CUDA): the correctness table.

Eight fixed chat prompts; for each dtype, transformers' greedy `generate` and fgchat's engine in
every mode (and on the plain path, fused kernels off), the first N tokens of each, one prompt at a
time; in full mode also the eight submitted together (one admission round: the one-pass prefill,
then decode at batch 8); plus the last prompt position's logits of each fgchat path (and of the
one-pass prefill of all eight) against fgchat's CPU float32 logits. Used by
scripts/check_real_weights.py (the README's Correctness table) and tests/gpu/test_gpu_real_weights.py.
`run_cpu` is the CPU's table: fgchat's CPU path in float32 and bf16 against transformers on CPU.
"""

from __future__ import annotations

import time

import torch

from fgchat.protocol.events import MODES, Mode

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CUDA graph is in one sentence.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for staying focused while studying.",
]
DTYPES = ("bfloat16", "float16")


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_tokens(source: tuple[str, dict[str, str]], dtype: torch.dtype, prompts: list[list[int]], n: int,
              device: str = "cuda") -> list[list[int]]:
    """transformers' greedy tokens; source: resolve.pretrained_source's (path, keyword arguments)."""
    from transformers import AutoModelForCausalLM

    path, kwargs = source
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    eos = model.generation_config.eos_token_id
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               temperature=None, top_p=None, top_k=None, eos_token_id=eos,
                               pad_token_id=eos if isinstance(eos, int) else (eos or [0])[0])
            out.append(y[0, len(ids):].tolist())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def fgchat_tokens(engine, prompts: list[list[int]], n: int, mode: str) -> list[list[int]] | None:
    """Greedy tokens of each prompt alone in `mode`; None where any decode step ran in another
    mode (the mode is unavailable or fell back), so no column claims a mode that did not run."""
    from fgchat.protocol.events import SamplingParams, TokenEvent

    engine.set_mode(mode)
    out = []
    for ids in prompts:
        rid = engine.submit(ids, SamplingParams(max_tokens=n))
        events = [e for e in engine.run_until_done() if isinstance(e, TokenEvent) and e.request_id == rid]
        if any(e.mode != mode for e in events[1:]):  # the first token comes from the prefill
            return None
        out.append([e.token_id for e in events])
    return out


def fgchat_tokens_together(engine, prompts: list[list[int]], n: int, mode: str) -> list[list[int]]:
    """Every prompt submitted before the first step: admitted, prefilled and decoded together."""
    from fgchat.protocol.events import SamplingParams, TokenEvent

    engine.set_mode(mode)
    rids = [engine.submit(ids, SamplingParams(max_tokens=n)) for ids in prompts]
    events = engine.run_until_done()
    return [[e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == r] for r in rids]


def one_pass_logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Last logits of every prompt from one prefill pass over all of them (slots 0..n-1)."""
    from fgchat.engine.model.prefill import prefill_many, prefill_many_fused

    run = prefill_many_fused if engine.decoder.fused else prefill_many
    batch = [(torch.tensor(ids, device=engine.device), slot) for slot, ids in enumerate(prompts)]
    with torch.inference_mode():
        return [lg.float().cpu() for lg in run(engine.decoder, batch, engine.cache.k, engine.cache.v)]


def prefill_logits(engine, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids, device=engine.device)
    with torch.inference_mode():
        return engine.decoder.prefill(t, 0, engine.cache.k, engine.cache.v).float().cpu()


def compare_logits(lg: torch.Tensor, ref: torch.Tensor) -> dict:
    """One position's logits [V] against the reference: the start-up check's comparison."""
    from fgchat.engine.startup_check import compare

    c = compare(lg[None], ref[None], torch.float32)
    return {"rel": c.max_rel_err, "top1_equal": c.top1_equal, "top5_overlap": c.top5_overlap}


def run_all(model: str, tokens: int = 16, dtypes: tuple[str, ...] = DTYPES) -> dict:
    """Every run of the table; see the module doc."""
    from fgchat.protocol.config import EngineConfig
    from fgchat.protocol.tuning import Tuning
    from fgchat.engine.core import Engine
    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.loader import load_model
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.model.resolve import pretrained_source

    source = pretrained_source(model)
    cpu = load_model(model, torch.device("cpu"), torch.float32)
    prompts = [chat_ids(cpu.tokenizer, p) for p in PROMPTS]
    ref_dec = Decoder(cpu.cfg, cpu.weights, 256)
    ref_cache = KVCache(cpu.cfg, 256, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        ref_logits = [ref_dec.prefill(torch.tensor(ids), 0, ref_cache.k, ref_cache.v) for ids in prompts]
    del cpu, ref_dec, ref_cache
    from fgchat.bench.runner import _git_commit

    commit = _git_commit()
    result: dict = {"commit": commit, "gpu": torch.cuda.get_device_name(), "prompts": PROMPTS,
                    "tokens": tokens, "runs": {}, "logits": {}, "check": {}, "reference": {}}
    # a quantized file's own blocks: their reference is the float32 forward over the same values
    quantized = str(model).lower().endswith(".gguf")
    if quantized:
        result["runs"]["transformers float32"] = hf_tokens(source, torch.float32, prompts, tokens)
    for dt_name in dtypes:
        dt = getattr(torch, dt_name)
        result["runs"][f"transformers {dt_name}"] = hf_tokens(source, dt, prompts, tokens)
        variants = [(True, False), (False, False)] + ([(True, True)] if quantized else [])
        for fused, dequantize in variants:
            t0 = time.perf_counter()
            engine = Engine(EngineConfig(model=model, dtype=dt_name, dequantize=dequantize,
                                         tuning=Tuning(fused=fused, prefix_reuse=False)))
            start_s = time.perf_counter() - t0
            label = " dequantized" if dequantize else "" if fused else " plain"
            info = engine.info()
            if quantized and not dequantize:
                result["weights"] = info.weights
            result["check"][f"{dt_name}{label}"] = {"start_s": start_s, "notes": info.notes,
                                                     "startup_check": info.startup_check}
            for mode in (MODES if fused else (Mode.FULL,)):
                toks = fgchat_tokens(engine, prompts, tokens, mode)
                if toks is None:
                    result["check"][f"{dt_name}{label}"][f"{mode} not run"] = engine.modes.unavailable.get(mode, "")
                else:
                    result["runs"][f"fgchat {mode}{label} {dt_name}"] = toks
            if fused and not dequantize:
                result["runs"][f"fgchat full, 8 together {dt_name}"] = fgchat_tokens_together(
                    engine, prompts, tokens, Mode.FULL)
                result["logits"][f"fgchat one pass of 8 {dt_name}"] = [
                    compare_logits(lg, ref) for lg, ref in zip(one_pass_logits(engine, prompts), ref_logits)]
            result["logits"][f"fgchat{label} {dt_name}"] = [
                compare_logits(prefill_logits(engine, ids), ref) for ids, ref in zip(prompts, ref_logits)]
            del engine
            torch.cuda.empty_cache()
    if quantized:  # every run on the file's own blocks
        result["reference"] = {run: "transformers float32" for run in result["runs"]
                               if run.startswith("fgchat") and " dequantized" not in run}
    return result


def run_cpu(model: str, tokens: int = 32, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """The CPU's table: fgchat on CPU (eager, plain torch ops) in each dtype against
    transformers on CPU in the same dtype and in float32, the first `tokens` greedy tokens of each
    prompt."""
    from fgchat.protocol.config import EngineConfig
    from fgchat.engine.core import Engine
    from fgchat.engine.model.resolve import pretrained_source
    from fgchat.bench.runner import _git_commit
    from fgchat.protocol.tuning import Tuning

    source = pretrained_source(model)
    result: dict = {"commit": _git_commit(), "gpu": "CPU", "prompts": PROMPTS, "tokens": tokens,
                    "runs": {}, "logits": {}, "check": {}}
    prompts: list[list[int]] = []
    for dt_name in dtypes:
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=model, device="cpu", dtype=dt_name, tuning=Tuning(prefix_reuse=False)))
        info = engine.info()
        result["check"][dt_name] = {"start_s": time.perf_counter() - t0, "notes": info.notes,
                                    "startup_check": info.startup_check}
        prompts = [chat_ids(engine.tokenizer, p) for p in PROMPTS]
        result["runs"][f"fgchat eager {dt_name}"] = fgchat_tokens(engine, prompts, tokens, Mode.EAGER)
        del engine
    for dt_name in dtypes:
        result["runs"][f"transformers {dt_name}"] = hf_tokens(source, getattr(torch, dt_name), prompts,
                                                              tokens, device="cpu")
    return result


def equal_to(r: dict, run: str, reference: str) -> int:
    """Prompts whose tokens in `run` equal those of `reference` (two keys of r["runs"])."""
    return sum(first_divergence(a, b) is None for a, b in zip(r["runs"][run], r["runs"][reference]))


def reference_of(r: dict, run: str) -> str:
    """The run a fgchat run is compared with: transformers in the same dtype, or, for a quantized
    file's own blocks, transformers float32 over the same (dequantized) values."""
    return r.get("reference", {}).get(run, f"transformers {run.split()[-1]}")


def equal_counts(r: dict) -> dict[str, int]:
    """Per fgchat run: prompts whose tokens equal its reference's (reference_of)."""
    return {c: equal_to(r, c, reference_of(r, c)) for c in r["runs"] if c.startswith("fgchat")}


def print_table(r: dict) -> None:
    cols = [k for k in r["runs"] if not k.startswith("transformers")]
    print(f"\ncommit {r['commit']}, {r['gpu']}, first {r['tokens']} greedy tokens; '=' equals transformers"
          " (same dtype), else the first differing position")
    if r.get("reference"):
        print(f"weights {r.get('weights', '?')} (the file's blocks): columns without 'dequantized' are compared "
              "with transformers float32 over the same values")
    print("| prompt | " + " | ".join(c.replace("fgchat ", "") for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    totals = dict.fromkeys(cols, 0)
    for i, p in enumerate(r["prompts"]):
        cells = []
        for c in cols:
            d = first_divergence(r["runs"][c][i], r["runs"][reference_of(r, c)][i])
            cells.append("=" if d is None else f"@{d}")
            totals[c] += d is None
        print(f"| {p} | " + " | ".join(cells) + " |")
    print("| **equal** | " + " | ".join(f"{totals[c]}/8" for c in cols) + " |")
    print("\nlast prompt position's logits vs fgchat CPU float32 (max rel error, top-1 equal, min top-5 overlap):")
    for k, rows in r["logits"].items():
        print(f"  {k}: rel <= {max(x['rel'] for x in rows):.2e}, top-1 {sum(x['top1_equal'] for x in rows)}/8,"
              f" top-5 >= {min(x['top5_overlap'] for x in rows)}")
    for k, v in r["check"].items():
        print(f"  start {k}: {v['start_s']:.1f} s, check {v['startup_check']}")
        for key, why in v.items():
            if key.endswith(" not run"):
                print(f"  {k}: {key} ({why or 'fell back during the run'})")

