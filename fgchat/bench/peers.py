"""transformers' `generate` as a peer, timed the same way on the same prompts.

TTFT = wall time of generate(max_new_tokens=1); TPOT = (wall(N) - wall(1)) / (N - 1), both after
warm-up and with the device synchronised, so the numbers compare with ours per output token.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from fgchat.bench.runner import BenchSpec, prompts_for, stats


def _hf_model(spec: BenchSpec, device: torch.device, dtype: torch.dtype):
    import transformers

    from fgchat.engine.loader import load_preset_config

    if spec.preset:
        raw = dict(load_preset_config(spec.preset))
        cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        from fgchat.engine.model.resolve import resolve_model

        path = resolve_model(spec.model).path
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_generate(model, ids: torch.Tensor, n: int, static: bool) -> float:
    kw: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    _sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kw)
    _sync(ids.device)
    return (time.perf_counter() - t0) * 1000.0


def _measure(model, spec: BenchSpec, batch: int, device, static: bool, name: str) -> dict[str, Any]:
    prompts = prompts_for(batch, spec.prompt_len, model.config.vocab_size)
    ids = torch.tensor(prompts, device=device)
    for _ in range(max(spec.warmup, 1) + (1 if static else 0)):
        _time_generate(model, ids, 1, static)
        _time_generate(model, ids, spec.output_len, static)
    ttft, tpot = [], []
    for _ in range(spec.repeats):
        t1 = _time_generate(model, ids, 1, static)
        tn = _time_generate(model, ids, spec.output_len, static)
        ttft.append(t1)
        tpot.append((tn - t1) / (spec.output_len - 1))
    return {
        "runner": name, "mode": name, "batch_size": batch, "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot), "itl_ms": stats(tpot), "gpu_step_ms": stats([]),
        "host_overhead_ms": None, "requests": batch * spec.repeats,
        "output_tokens_per_s": float(batch * 1000.0 / np.mean(tpot)),
    }


def run_hf_peers(spec: BenchSpec, loaded, advance: Callable[[str], None]):
    """Returns (runs, skipped). A peer that cannot run is a skipped row, never a crash."""
    from fgchat.engine.loader import pick_device, pick_dtype

    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    try:
        model = _hf_model(spec, device, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure marks the peer rows
        return [], [{"runner": "hf", "reason": f"could not build the transformers model: {exc}"}]
    wanted = set()
    for p in spec.peers:
        wanted |= {"hf-eager", "hf-compile"} if p == "hf" else {p}
    for b in spec.batch_sizes if "hf-eager" in wanted else []:
        advance(f"hf-eager batch {b}")
        try:
            runs.append(_measure(model, spec, b, device, False, "hf-eager"))
        except Exception as exc:  # noqa: BLE001
            skipped.append({"runner": "hf-eager", "reason": str(exc).splitlines()[0][:200]})
    if "hf-compile" not in wanted:
        return runs, skipped
    try:
        if getattr(model.generation_config, "disable_compile", None) is not None:
            model.generation_config.disable_compile = True
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    except Exception as exc:  # noqa: BLE001
        skipped.append({"runner": "hf-compile", "reason": f"torch.compile unavailable: {exc}"})
        return runs, skipped
    for b in spec.batch_sizes:
        advance(f"hf-compile batch {b}")
        try:
            runs.append(_measure(model, spec, b, device, True, "hf-compile"))
        except Exception as exc:  # noqa: BLE001
            msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            skipped.append({"runner": "hf-compile", "reason": f"batch {b}: {msg}"})
    return runs, skipped
