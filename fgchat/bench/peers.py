"""transformers' `generate` as a peer, timed the same way on the same prompts.

Timing matches our engine's: one `generate(max_new_tokens=N)` call per repeat, a streamer stamps every new
token as it reaches the host; TTFT = first token - call start, TPOT = (last token - first token) / (N - 1),
ITL = the gaps between tokens, tokens/s = batch * N / call wall time. Warm-up calls are never counted.

hf-compile is transformers' own static-cache + compile path (`cache_implementation` static, `compile_config`):
`generate` runs the prefill eagerly and compiles only the one-token decode forward. To compile that once per
batch size and never again: shapes are static (`dynamic=False`, so a new batch size gets its own graph instead of
a slower dynamic-shape one), and each batch size reuses one `StaticCache`, reset in place between calls, so its
tensors keep their addresses (a fresh cache per call would make CUDA graphs re-record the decode step).

Each peer has a time budget (`--peer-timeout`), checked between generate calls; once spent, the rest of that
peer is marked skipped with the reason and the run goes on (a call in progress is never interrupted).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable

import numpy as np
import torch

from fgchat.bench.spec import BenchSpec, prompts_for, stats


class _OverBudget(Exception):
    pass


def _hf_model(spec: BenchSpec, device: torch.device, dtype: torch.dtype):
    import transformers

    from fgchat.engine.loader import load_preset_config

    if spec.preset:
        raw = dict(load_preset_config(spec.preset))
        cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        from fgchat.engine.model.resolve import pretrained_source

        path, kwargs = pretrained_source(spec.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs_compiled() -> int | None:
    """Graphs dynamo has compiled in this process so far (a recompile is one more); None if unknown."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - only a diagnostic
        return None


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


class _TokenClock:
    """A generate streamer that only stamps the time each step's tokens reach the host."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:  # generate hands the prompt over first, as (batch, prompt_len)
            return
        self.times.append(time.perf_counter())  # .cpu() in generate already synchronised

    def end(self) -> None:
        pass


class _Compiled:
    """transformers' static-cache + compiled-decode `generate`, one StaticCache per batch size."""

    def __init__(self, model, spec: BenchSpec):
        from transformers import CompileConfig

        self.model = model
        self.max_len = spec.prompt_len + spec.output_len
        self.config = CompileConfig(mode="reduce-overhead", dynamic=False)
        # generate only compiles on CUDA-like devices unless told otherwise; elsewhere this keeps the label true
        self.config._compile_all_devices = True
        if getattr(model.generation_config, "disable_compile", None):
            model.generation_config.disable_compile = False
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed during transformers 5.x
        self.caches: dict[int, Any] = {}
        self.seen_compile = False
        self.decode_calls = 0
        fn = model.get_compiled_call(self.config)  # fails here, not mid-run, where torch.compile is unusable
        if getattr(model, "_compiled_call", None) is fn:  # count the calls generate makes to it (a check only)
            def counted(*args, **kwargs):
                self.decode_calls += 1
                return fn(*args, **kwargs)

            model._compiled_call = counted

    def kwargs(self, batch: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"compile_config": self.config}
        cache = self.caches.get(batch)
        if cache is None:
            try:
                from transformers import StaticCache

                cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
            except Exception:  # noqa: BLE001 - another StaticCache signature: a fresh cache per call
                cache = False
            self.caches[batch] = cache
        if cache is False:
            kw["cache_implementation"] = "static"
        else:
            cache.reset()  # in place: same tensors, so the compiled decode step and its CUDA graph stay valid
            kw[self.cache_kw] = cache
        return kw

    def release(self, batch: int) -> None:
        self.caches.pop(batch, None)


def _generate(model, ids: torch.Tensor, n: int, extra: Callable[[], dict[str, Any]]) -> tuple[list[float], float]:
    """One timed generate call: (per-token times in ms since the call started, wall ms)."""
    clock = _TokenClock()
    kw: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    # the static cache is made and reset under inference mode too: tensors of one kind, no guard flips
    with torch.inference_mode():
        kw.update(extra())
        _sync(ids.device)
        t0 = time.perf_counter()
        model.generate(ids, streamer=clock, **kw)
        _sync(ids.device)
    wall = (time.perf_counter() - t0) * 1000.0
    times = [(t - t0) * 1000.0 for t in clock.times]
    if len(times) != n:
        raise RuntimeError(f"generate produced {len(times)} token steps, expected {n}")
    return times, wall


def _measure(model, spec: BenchSpec, batch: int, device, name: str, compiled: _Compiled | None,
             deadline: float) -> dict[str, Any]:
    prompts = prompts_for(batch, spec.prompt_len, model.config.vocab_size)
    ids = torch.tensor(prompts, device=device)
    n = spec.output_len

    def call(phase: str) -> tuple[list[float], float]:
        if time.perf_counter() > deadline:
            raise _OverBudget(f"batch {batch} ({phase})")
        return _generate(model, ids, n, (lambda: compiled.kwargs(batch)) if compiled else dict)

    g0, t0 = _graphs_compiled(), time.perf_counter()
    # compile (first call) + one more so the timed calls start from steady state (CUDA graphs recorded)
    for i in range(max(spec.warmup, 1) + (1 if compiled else 0)):
        call(f"warm-up {i + 1}")
    warm_s, g1 = time.perf_counter() - t0, _graphs_compiled()
    ttft, tpot, itl, tok_s = [], [], [], []
    for i in range(spec.repeats):
        times, wall = call(f"repeat {i + 1}")
        ttft += [times[0]] * batch  # one sample per request, as ours
        tpot += [(times[-1] - times[0]) / (n - 1)] * batch
        itl += list(np.diff(times))
        tok_s.append(batch * n / (wall / 1000.0))
    g2 = _graphs_compiled()
    if compiled and not compiled.seen_compile:
        if _delta(g0, g1) == 0 and compiled.decode_calls == 0:  # it would be eager under the compile label
            raise RuntimeError("generate did not compile the decode step (transformers' compile criteria not met)")
        compiled.seen_compile = True
    return {
        "runner": name, "mode": name, "batch_size": batch, "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot), "itl_ms": stats(itl), "gpu_step_ms": stats([]),
        "host_overhead_ms": None, "requests": batch * spec.repeats,
        "output_tokens_per_s": float(np.mean(tok_s)),
        "warmup_s": warm_s, "graphs_compiled_warmup": _delta(g0, g1), "graphs_compiled_timed": _delta(g1, g2),
    }


def _run_peer(model, spec: BenchSpec, device, name: str, compiled: _Compiled | None, budget_s: float,
              advance: Callable[[str], None], runs: list[dict[str, Any]], skipped: list[dict[str, str]]) -> None:
    """Each batch size's row appended to `runs` (or its reason to `skipped`) as it finishes."""
    start = time.perf_counter()
    deadline = start + budget_s
    left: list[int] = []
    for b in spec.batch_sizes:
        advance(f"{name} batch {b}")
        if left:
            left.append(b)
            continue
        try:
            runs.append(_measure(model, spec, b, device, name, compiled, deadline))
        except _OverBudget as exc:
            left.append(b)
            where = str(exc)
        except Exception as exc:  # noqa: BLE001 - a failed batch size marks its row, the run goes on
            msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            skipped.append({"runner": name, "reason": f"batch {b}: {msg}"})
        finally:
            if compiled:
                compiled.release(b)
    if left:
        spent = time.perf_counter() - start
        sizes = ", ".join(str(b) for b in left)
        skipped.append({"runner": name, "reason": (
            f"time budget --peer-timeout {budget_s:g} s spent after {spent:.0f} s, at {where}; "
            f"batch size(s) {sizes} not measured")})


def run_hf_peers(spec: BenchSpec, loaded, advance: Callable[[str], None],
                 runs: list[dict[str, Any]] | None = None, skipped: list[dict[str, str]] | None = None):
    """Returns (runs, skipped), the given lists when passed: each row is appended as it finishes,
    so an interrupt keeps the rows already measured. A peer that cannot run is a skipped row,
    never a crash."""
    from fgchat.engine.devices import pick_device, pick_dtype

    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    budget = float(spec.peer_timeout)
    runs = [] if runs is None else runs
    skipped = [] if skipped is None else skipped
    try:
        model = _hf_model(spec, device, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure marks the peer rows
        skipped.append({"runner": "hf", "reason": f"could not build the transformers model: {exc}"})
        return runs, skipped
    wanted = set()
    for p in spec.peers:
        wanted |= {"hf-eager", "hf-compile"} if p == "hf" else {p}
    if "hf-eager" in wanted:
        _run_peer(model, spec, device, "hf-eager", None, budget, advance, runs, skipped)
    if "hf-compile" not in wanted:
        return runs, skipped
    try:
        compiled = _Compiled(model, spec)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        skipped.append({"runner": "hf-compile", "reason": f"torch.compile unavailable: {msg}"})
        return runs, skipped
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    old_limit = getattr(torch._dynamo.config, limit_name)
    # one static graph per batch size must fit under dynamo's per-function limit (8 by default), else eager
    setattr(torch._dynamo.config, limit_name, max(old_limit, 2 * len(spec.batch_sizes) + 8))
    try:
        _run_peer(model, spec, device, "hf-compile", compiled, budget, advance, runs, skipped)
    finally:
        setattr(torch._dynamo.config, limit_name, old_limit)
    return runs, skipped
