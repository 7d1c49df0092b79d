"""Runs the benchmark grid on our engine (and peers) with one timing method."""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from fgchat.bench.interrupted import keeping_finished_runs
from fgchat.bench.prompt_sets import RANDOM, batch_prompts, prompt_set_ids
from fgchat.bench.spec import BenchSpec, prompts_for, stats

PENALTIES = (1.1, 0.5, 0.25)  # repetition, presence, frequency of `bench --penalties`
ORACLE_ROUNDS = 8  # greedy oracle rounds at most while the oracle's drafts settle (settle_oracle)
from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.quant.describe import FLOAT_FORMATS
from fgchat.metrics.stats import bandwidth_share
from fgchat.protocol.events import EngineInfo, Mode, RequestFinished, SamplingParams, TokenEvent
from fgchat.protocol.tuning import Tuning


def _cpu_name() -> str:
    """The host CPU's model name: eager and piecewise are launch-bound, so their times follow it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    import os

    if os.environ.get("FGCHAT_COMMIT"):
        return os.environ["FGCHAT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def measure_engine(engine: Engine, mode: str, batch: int, spec: BenchSpec, method: str = "off",
                   prompt_set: list[list[int]] | None = None) -> dict[str, Any]:
    """One row: `mode` at `batch`, speculating with `method` ("off": plain decoding). prompt_set: the
    token ids of a --prompts set, whose requests stop at end of sequence; None: random prompts of
    --prompt-len, each generating --output-len tokens."""
    engine.set_mode(mode)
    if prompt_set is None:
        prompts = prompts_for(batch, spec.prompt_len, engine.cfg.vocab_size)
    else:
        prompts = batch_prompts(prompt_set, batch)
    pen = dict(zip(("repetition_penalty", "presence_penalty", "frequency_penalty"), PENALTIES)) if spec.penalties else {}
    params = [SamplingParams(max_tokens=spec.output_len, ignore_eos=prompt_set is None, temperature=spec.temperature,
                             top_k=spec.top_k, seed=i, **pen) for i in range(len(prompts))]
    plain = _greedy(engine, prompts, params) if method == "oracle" else None  # speculation still off
    if method != "off":  # the plain rows never touch speculation (the engine runs with it off)
        engine.set_speculation(method, spec.draft_len)
    # graphs captured on first use (mega; the verification's) are taken before timing, for every
    # batch size a round passes through as its requests end
    engine.capture_sizes(mode, list(range(1, batch + 1)))
    oracle = None
    if plain is not None:
        oracle, drafts = settle_oracle(engine, prompts, params, plain)
        params = [dataclasses.replace(p, oracle_tokens=t) for p, t in zip(params, drafts)]
    all_tokens: list[TokenEvent] = []
    ttft, tpot, itl, gpu, launch, steps_wall = [], [], [], [], [], []
    decode_modes: set[str] = set()
    tok_s, round_tpot = [], []
    counts: list[int] = []
    timed_captures = 0
    for rep in range(spec.warmup + spec.repeats):
        for p, sp in zip(prompts, params):
            engine.submit(p, sp)
        held = len(engine.info().captures)
        t0 = time.perf_counter()
        events = engine.run_until_done()
        wall = time.perf_counter() - t0
        if rep < spec.warmup:
            # what the warm-up captured on first use (the batch route's prefill graph) comes after
            # the decode graphs: the idle passes capture those again, as the chat's engine does
            while engine.capture_idle():
                pass
            continue
        timed_captures += len(engine.info().captures) - held
        toks = [e for e in events if isinstance(e, TokenEvent)]
        done = [e.summary for e in events if isinstance(e, RequestFinished)]
        ttft += [s.ttft_ms for s in done]
        round_of = [s.tpot_ms for s in done if s.tpot_ms is not None]
        tpot += round_of
        round_tpot.append(float(np.mean(round_of)) if round_of else float("nan"))
        itl += [e.itl_ms for e in toks if not e.is_first_token]
        lead = min(s.request_id for s in done)
        lead_steps = [e for e in toks if e.request_id == lead and not e.is_first_token]
        gpu += [e.gpu_step_ms for e in lead_steps if e.gpu_step_ms is not None]
        launch += [e.launch_ms for e in lead_steps if e.launch_ms is not None]
        decode_modes |= {e.mode for e in toks if not e.is_first_token}
        all_tokens += toks
        tok_s.append(sum(s.output_tokens for s in done) / wall)
        counts = [s.output_tokens for s in sorted(done, key=lambda s: s.request_id)]
        steps_wall.append(wall)
    if method != "off":
        engine.set_speculation("off")
    out = {
        "runner": f"fgchat-{mode}" + (f"+{method}" if method != "off" else ""), "mode": mode,
        "batch_size": batch, "speculate": method, **spec_figures(all_tokens),
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl),
        "gpu_step_ms": stats(gpu), "launch_ms": stats(launch), "output_tokens_per_s": float(np.mean(tok_s)),
        "decode_modes": sorted(decode_modes), "requests": len(ttft),
        "tpot_ms_by_round": round_tpot,
        # each request's generated tokens in the last timed round, in prompt order (a set's
        # requests stop at end of sequence; greedy plain and speculated rows generate the same)
        "output_tokens": counts,
        # graphs captured inside the timed rounds (the target's and a draft model's): 0 unless a
        # shape escaped the warm-up, whose capture time then sits in the figures above
        "captures_timed": timed_captures,
    }
    if oracle is not None:
        out["oracle"] = oracle
    g, i = out["gpu_step_ms"]["mean"], out["itl_ms"]["mean"]
    out["host_overhead_ms"] = (i - g) if (g is not None and i is not None) else None
    return out


def _greedy(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each prompt's greedy continuation (its request's tokens) under `params` at temperature 0."""
    rids = [engine.submit(p, dataclasses.replace(sp, temperature=0.0)) for p, sp in zip(prompts, params)]
    done = {e.summary.request_id: e.summary.token_ids for e in engine.run_until_done()
            if isinstance(e, RequestFinished)}
    return [list(done[r]) for r in rids]


def settle_oracle(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                  plain: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    """The oracle's drafts for the timed rounds: each prompt's greedy continuation in this engine,
    first its plain decode steps' (`plain`), then as the verification step computes it: greedy
    oracle rounds, each drafted by the last one's tokens, until a round emits the tokens it was
    drafted from (ORACLE_ROUNDS at most). The verification step and a plain step may round a
    near-tied argmax apart (random weights in bf16 meet that every few tokens): drafts from the
    plain run alone then stop holding from that token on. (what the oracle proposes from, for the
    run's JSON; the drafts)"""
    drafts, rounds, settled = plain, 0, False
    while rounds < ORACLE_ROUNDS and not settled:
        rounds += 1
        got = _greedy(engine, prompts, [dataclasses.replace(p, oracle_tokens=t) for p, t in zip(params, drafts)])
        settled, drafts = got == drafts, got
    unlike = [next((i for i, (a, b) in enumerate(zip(p, d)) if a != b), None if len(p) == len(d) else min(len(p), len(d)))
              for p, d in zip(plain, drafts)]
    return {
        "drafts_from": "each prompt's greedy run in this engine: plain steps, then oracle rounds until "
                       "one reproduces its drafts",
        "rounds": rounds, "reproduced": settled,
        # per prompt: the first token where the verification step's greedy run left the plain one
        "first_token_unlike_plain": unlike,
    }, drafts


def spec_figures(tokens: list[TokenEvent]) -> dict[str, Any]:
    """acceptance_rate and tokens_per_step of the speculated steps among `tokens` (None when none)."""
    from fgchat.metrics.records import LatencyLog
    from fgchat.metrics.spec_window import SpecWindow

    log = LatencyLog(start_ns=0)
    for ev in tokens:
        log.add_token(ev, "")
    f = SpecWindow(log, max(1, len(tokens))).figures()
    return {"acceptance_rate": f.acceptance_rate if f else None, "tokens_per_step": f.tokens_per_step if f else None,
            "spec_steps": f.steps if f else 0}


def _engine(spec: BenchSpec, quantize: str, need: int, tuning: Tuning) -> Engine:
    return Engine(EngineConfig(
        model=spec.model, preset=spec.preset, device=spec.device, dtype=spec.dtype,
        max_context=spec.max_context or need, mode=Mode.EAGER, attention=spec.attention,
        outliers=spec.outliers, tuning=tuning, quantize=quantize, dequantize=spec.dequantize,
        draft=spec.draft, draft_len=spec.draft_len,
    ))


def weights_label(quantize: str, weights: str) -> str:
    """What names a weight set in runner labels ("fgchat-full-int4"): the --quantize value, else a
    quantized file's format as the engine holds it; "" for float weights (plain "fgchat-full")."""
    if quantize != "none":
        return quantize
    return "" if weights in FLOAT_FORMATS.values() else weights


def weight_set(quantize: str, label: str, info: EngineInfo) -> dict[str, Any]:
    return {"quantize": quantize, "label": label, "weights": info.weights, "weight_bytes": info.weight_bytes,
            "step_bytes": info.step_bytes,
            "startup_check": asdict(info.startup_check) if info.startup_check else None}


def label_run(run: dict[str, Any], ws: dict[str, Any], peak: float | None) -> dict[str, Any]:
    """A run of a weight set: its runner label, weights, bytes and the share of the GPU's peak
    bandwidth its steps reached."""
    if ws["label"]:
        run["runner"] = f"{run['runner']}-{ws['label']}"
    run.update(weights_label=ws["label"], weights=ws["weights"], weight_bytes=ws["weight_bytes"],
               step_bytes=ws["step_bytes"])
    run["bandwidth_share"] = bandwidth_share(ws["step_bytes"], run["gpu_step_ms"]["mean"], peak)
    return run


def _release() -> None:
    """Free the memory of an engine no longer referenced, before the next weight set's or the
    peers' (the frozen heap is collected whole: an engine's cycles were frozen with it)."""
    import gc

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_all(spec: BenchSpec) -> dict[str, Any]:
    from fgchat.bench.progress import progress_bar
    from fgchat.engine.heap import freeze_heap
    from fgchat.protocol.errors import FgchatError

    prompt_set = None if spec.prompts == RANDOM else prompt_set_ids(spec.model, spec.preset, spec.prompts)
    longest = spec.prompt_len if prompt_set is None else max(map(len, prompt_set))
    need = longest + spec.output_len + 8
    # every round prefills its prompts afresh: no slot's rows from an earlier round are reused
    tuning = dataclasses.replace(Tuning.from_env(), prefix_reuse=False)
    quantize = spec.quantize or ["none"]
    engine: Engine | None = _engine(spec, quantize[0], need, tuning)
    if engine.max_context < need:
        raise FgchatError(f"prompt + output ({need} tokens) exceed the context ({engine.max_context})")

    frozen = freeze_heap(collect=True)  # no full collection of the whole heap inside a timed round
    info = engine.info()
    first = weight_set(quantize[0], weights_label(quantize[0], info.weights), info)
    result: dict[str, Any] = {
        "meta": {
            "model": info.model_name, "architecture": info.architecture, "device": info.device,
            "dtype": info.dtype, "attention": info.attention_backend, "commit": _git_commit(),
            "fused_kernels": engine.decoder.fused,
            "pipelined": engine.pipelined,
            "pdl": engine.decoder.pdl,
            "tuning_changed": engine.tuning.changed(),
            "cpu_step": info.cpu_step or None,
            "gc_frozen_objects": frozen,
            "kernel_warmup_s": info.kernel_warmup_s,
            "startup_check": first["startup_check"],
            # the first weight set's; every set's in weight_sets (one per --quantize value)
            "weights": info.weights, "weight_bytes": info.weight_bytes, "step_bytes": info.step_bytes,
            "weight_sets": [first], "dequantize": spec.dequantize,
            "peak_bandwidth": info.peak_bandwidth,
            "torch": torch.__version__, "python": platform.python_version(), "host_cpu": _cpu_name(),
            # a --prompts set: its name (or file) and every prompt's token count; --prompt-len unused
            "prompts": spec.prompts, "prompt_len": spec.prompt_len if prompt_set is None else None,
            "prompt_tokens": None if prompt_set is None else [len(p) for p in prompt_set],
            "output_len": spec.output_len,
            "penalties": dict(zip(("repetition", "presence", "frequency"), PENALTIES)) if spec.penalties else None,
            "sampling": {"temperature": spec.temperature, "top_k": spec.top_k} if spec.temperature > 0 else None,
            "warmup": spec.warmup, "repeats": spec.repeats, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "interrupted": False,
            "speculate": list(spec.speculate), "draft": spec.draft, "draft_len": spec.draft_len,
        },
        "captures": [], "skipped": [], "runs": [],
    }
    available = [m for m in spec.modes if not info.available_modes.get(m, "")]
    total = len(quantize) * len(available) * len(spec.batch_sizes) * len(spec.speculate) + len(spec.peers) * 2 * len(spec.batch_sizes)
    with keeping_finished_runs(result), progress_bar(total, spec.progress) as advance:
        for i, q in enumerate(quantize):
            if i:
                engine = None
                _release()
                try:
                    engine = _engine(spec, q, need, tuning)
                except FgchatError as exc:  # the sets measured so far stay
                    result["skipped"].append({"runner": f"fgchat ({q})", "reason": str(exc)})
                    continue
                freeze_heap(collect=True)
                info = engine.info()
                result["meta"]["weight_sets"].append(weight_set(q, weights_label(q, info.weights), info))
            ws = result["meta"]["weight_sets"][-1]
            _measure_set(engine, info, ws, spec, result, advance, prompt_set)
        if spec.peers:
            from fgchat.bench.peers import run_hf_peers

            engine = None
            _release()
            run_hf_peers(spec, None, advance, result["runs"], result["skipped"])
    return result


def _measure_set(engine: Engine, info: EngineInfo, ws: dict[str, Any], spec: BenchSpec,
                 result: dict[str, Any], advance, prompt_set: list[list[int]] | None = None) -> None:
    """Every available mode at every batch size on one weight set's engine."""
    suffix = f"-{ws['label']}" if ws["label"] else ""
    first = len(result["captures"])
    result["captures"] += [{**asdict(c), "weights_label": ws["label"]} for c in info.captures]
    for mode in spec.modes:
        reason = info.available_modes.get(mode, "")
        if reason:
            result["skipped"].append({"runner": f"fgchat-{mode}{suffix}", "reason": reason})
            continue
        for method in spec.speculate:
            for b in spec.batch_sizes:
                row = f"{mode}{'+' + method if method != 'off' else ''}"
                advance(f"fgchat {row}{' ' + ws['label'] if ws['label'] else ''} batch {b}")
                run = measure_engine(engine, mode, b, spec, method, prompt_set)
                result["runs"].append(label_run(run, ws, info.peak_bandwidth))
                # every capture of the set so far, those the rows took (verification, mega) too
                result["captures"][first:] = [{**asdict(c), "weights_label": ws["label"]}
                                              for c in engine.info().captures]
