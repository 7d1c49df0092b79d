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
from fgchat.bench.spec import BenchSpec, prompts_for, stats

PENALTIES = (1.1, 0.5, 0.25)  # repetition, presence, frequency of `bench --penalties`
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.events import Mode, RequestFinished, SamplingParams, TokenEvent
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


def measure_engine(engine: Engine, mode: str, batch: int, spec: BenchSpec) -> dict[str, Any]:
    engine.set_mode(mode)
    engine.capture_sizes(mode, [batch])  # graphs captured on first use (mega) are taken before timing
    prompts = prompts_for(batch, spec.prompt_len, engine.cfg.vocab_size)
    pen = dict(zip(("repetition_penalty", "presence_penalty", "frequency_penalty"), PENALTIES)) if spec.penalties else {}
    params = [SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=spec.temperature,
                             top_k=spec.top_k, seed=i, **pen) for i in range(len(prompts))]
    ttft, tpot, itl, gpu, launch, steps_wall = [], [], [], [], [], []
    decode_modes: set[str] = set()
    tok_s, round_tpot = [], []
    for rep in range(spec.warmup + spec.repeats):
        for p, sp in zip(prompts, params):
            engine.submit(p, sp)
        t0 = time.perf_counter()
        events = engine.run_until_done()
        wall = time.perf_counter() - t0
        if rep < spec.warmup:
            # what the warm-up captured on first use (the batch route's prefill graph) comes after
            # the decode graphs: the idle passes capture those again, as the chat's engine does
            while engine.capture_idle():
                pass
            continue
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
        tok_s.append(sum(s.output_tokens for s in done) / wall)
        steps_wall.append(wall)
    out = {
        "runner": f"fgchat-{mode}", "mode": mode, "batch_size": batch,
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl),
        "gpu_step_ms": stats(gpu), "launch_ms": stats(launch), "output_tokens_per_s": float(np.mean(tok_s)),
        "decode_modes": sorted(decode_modes), "requests": len(ttft),
        "tpot_ms_by_round": round_tpot,
    }
    g, i = out["gpu_step_ms"]["mean"], out["itl_ms"]["mean"]
    out["host_overhead_ms"] = (i - g) if (g is not None and i is not None) else None
    return out


def run_all(spec: BenchSpec) -> dict[str, Any]:
    from fgchat.bench.progress import progress_bar

    need = spec.prompt_len + spec.output_len + 8
    # every round prefills its prompts afresh: no slot's rows from an earlier round are reused
    tuning = dataclasses.replace(Tuning.from_env(), prefix_reuse=False)
    engine = Engine(EngineConfig(
        model=spec.model, preset=spec.preset, device=spec.device, dtype=spec.dtype,
        max_context=spec.max_context or need, mode=Mode.EAGER, attention=spec.attention,
        outliers=spec.outliers, tuning=tuning,
    ))
    if engine.max_context < need:
        from fgchat.protocol.errors import FgchatError

        raise FgchatError(f"prompt + output ({need} tokens) exceed the context ({engine.max_context})")
    from fgchat.engine.heap import freeze_heap

    frozen = freeze_heap(collect=True)  # no full collection of the whole heap inside a timed round
    info = engine.info()
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
            "startup_check": asdict(info.startup_check) if info.startup_check else None,
            "torch": torch.__version__, "python": platform.python_version(), "host_cpu": _cpu_name(),
            "prompt_len": spec.prompt_len, "output_len": spec.output_len,
            "penalties": dict(zip(("repetition", "presence", "frequency"), PENALTIES)) if spec.penalties else None,
            "sampling": {"temperature": spec.temperature, "top_k": spec.top_k} if spec.temperature > 0 else None,
            "warmup": spec.warmup, "repeats": spec.repeats, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "interrupted": False,
        },
        "captures": [asdict(c) for c in info.captures],
        "skipped": [], "runs": [],
    }
    modes = []
    for mode in spec.modes:
        reason = info.available_modes.get(mode, "")
        if reason:
            result["skipped"].append({"runner": f"fgchat-{mode}", "reason": reason})
        else:
            modes.append(mode)
    total = len(modes) * len(spec.batch_sizes) + len(spec.peers) * 2 * len(spec.batch_sizes)
    with keeping_finished_runs(result), progress_bar(total, spec.progress) as advance:
        for mode in modes:
            for b in spec.batch_sizes:
                advance(f"fgchat {mode} batch {b}")
                result["runs"].append(measure_engine(engine, mode, b, spec))
        if spec.peers:
            from fgchat.bench.peers import run_hf_peers

            weights_like = engine.model
            del engine
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            run_hf_peers(spec, weights_like, advance, result["runs"], result["skipped"])
    return result
