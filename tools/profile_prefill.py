"""Time and profile prefill of one prompt on CUDA at Llama-3.2-1B shapes (random weights, bf16).

No Engine: Decoder + KVCache only, so the numbers are prefill alone (no tokenizer, sampling or
host->device copy of the prompt). For fused True and False it prints, per prefill of a random
prompt (warmup 3, repeats 20):
  ttft   wall time of one call + synchronize (what a request's first token waits for)
  gpu    CUDA-event time from before the call to after it (includes GPU idle while the host lags)
  host   time until the call returns (the launch work of the host)
  piped  wall time per call of `repeats` calls back to back (max(host, GPU) per call)
then causal attention alone at the prompt's shape by route (which SDPA backend runs), the host
cost per call of prefill's building blocks, and a torch.profiler table of one fused prefill: the
top CUDA kernels and the count of CPU-side ops.

    python tools/profile_prefill.py [--tokens 512] [--preset llama-3.2-1b] [--no-profile]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from fgchat.engine.kv_cache import KVCache
from fgchat.engine.loader import load_random
from fgchat.engine.model.decoder import Decoder


def time_prefill(dec: Decoder, cache: KVCache, ids: torch.Tensor, warmup: int, repeats: int) -> dict:
    def call():
        return dec.prefill(ids, 0, cache.k, cache.v)

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    ttft, gpu, host = [], [], []
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev0.record()
        call()
        ev1.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ttft.append((t2 - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
        gpu.append(ev0.elapsed_time(ev1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    torch.cuda.synchronize()
    piped = (time.perf_counter() - t0) * 1e3 / repeats
    med = statistics.median
    return {"ttft": med(ttft), "ttft_min": min(ttft), "gpu": med(gpu), "host": med(host), "piped": piped}


def time_cuda_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def attention_routes(cfg, t: int, dtype: torch.dtype) -> None:
    """Causal GQA attention at [T, Hq, D] x [T, Hkv, D] by route; which backend the default picks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fgchat.engine.kernels.attention.base import cache_heads_first
    from fgchat.engine.model.prefill import heads_first, sdpa_causal

    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype, generator=g)
    cache = torch.randn(2, 4096, 2 * hkv, d, device="cuda", dtype=dtype, generator=g)
    k, v = cache[1, :t, :hkv], cache[1, :t, hkv:]  # strided like the KV-cache views prefill uses
    kc = torch.randn(8, 4096, hkv, d, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(8, 4096, hkv, d, device="cuda", dtype=dtype, generator=g)
    q4, k4, v4 = q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2)
    rep = hq // hkv
    ke = k4.repeat_interleave(rep, dim=1)
    ve = v4.repeat_interleave(rep, dim=1)
    scale = d**-0.5

    def sdpa(kk, vv, gqa):
        return F.scaled_dot_product_attention(q4, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)

    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q4.float(), ke.float(), ve.float(), is_causal=True, scale=scale)
    default = sdpa(k4, v4, hq != hkv)
    kc[3, :t], vc[3, :t] = k, v
    routes = {
        "prefill path (as_strided views)": lambda: sdpa_causal(
            heads_first(q), cache_heads_first(kc, 3, t), cache_heads_first(vc, 3, t), scale),
        "gqa views, default dispatch": lambda: sdpa(k4, v4, hq != hkv),
        "repeat_interleave + sdpa": lambda: sdpa(k4.repeat_interleave(rep, 1), v4.repeat_interleave(rep, 1), False),
    }
    forced = {"FLASH gqa": (SDPBackend.FLASH_ATTENTION, True), "FLASH expanded": (SDPBackend.FLASH_ATTENTION, False),
              "CUDNN expanded": (SDPBackend.CUDNN_ATTENTION, False), "CUDNN gqa": (SDPBackend.CUDNN_ATTENTION, True),
              "EFFICIENT expanded": (SDPBackend.EFFICIENT_ATTENTION, False),
              "MATH gqa": (SDPBackend.MATH, True)}
    print(f"\nattention alone, T={t} Hq={hq} Hkv={hkv} D={d} {str(dtype).split('.')[-1]} (ms per layer, "
          "launch included; err vs fp32 math; 'same bits' = equals the default dispatch)")
    print(f"  {'route':34s} {'ms':>7s}  {'max err':>8s}  same bits")
    for name, fn in routes.items():
        out = fn()
        err = (out.float().reshape(ref.shape) if out.dim() == 4 else
               out.float().view(t, hq, d).transpose(0, 1)[None]) - ref
        print(f"  {name:34s} {time_cuda_ms(fn):7.4f}  {err.abs().max().item():8.2e}")
    for name, (backend, gqa) in forced.items():
        kk, vv = (k4, v4) if gqa else (ke, ve)
        try:
            with sdpa_kernel([backend]):
                out = sdpa(kk, vv, gqa)
                ms = time_cuda_ms(lambda: sdpa(kk, vv, gqa))
        except RuntimeError as exc:
            print(f"  {'forced ' + name:34s} {'n/a':>7s}  ({str(exc).splitlines()[0][:60]})")
            continue
        same = torch.equal(out, default) if gqa else "-"
        print(f"  {'forced ' + name:34s} {ms:7.4f}  {(out.float() - ref).abs().max().item():8.2e}  {same}")


def host_costs(cfg, dtype: torch.dtype, n: int = 300) -> None:
    """Host time per call of prefill's building blocks on 8 rows (GPU work negligible)."""
    from fgchat.engine.kernels import fused as fk
    from fgchat.engine.kernels.attention.base import cache_heads_first
    from fgchat.engine.model.prefill import heads_first, sdpa_causal

    rows, hid, hq, hkv, d = 8, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dev = torch.device("cuda")
    h = torch.randn(rows, hid, device=dev, dtype=dtype)
    wn = torch.ones(hid, device=dev, dtype=dtype)
    wl = torch.randn(256, hid, device=dev, dtype=dtype)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device=dev, dtype=dtype)
    cos = torch.randn(4096, d, device=dev, dtype=dtype)
    kc = torch.zeros(8, 4096, hkv, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    pos = torch.arange(rows, device=dev)
    slots = torch.zeros(rows, dtype=torch.int64, device=dev)
    gu = torch.randn(rows, 2 * cfg.intermediate_size, device=dev, dtype=dtype)
    q = torch.randn(rows, hq, d, device=dev, dtype=dtype)
    q4, k4 = heads_first(q), cache_heads_first(kc, 0, rows)
    a = torch.randn(rows, hq * d, device=dev, dtype=dtype)
    items = {
        "fused.add_rms_norm (with delta)": lambda: fk.add_rms_norm(h, h, wn, 1e-5),
        "fused.rope_kv_write": lambda: fk.rope_kv_write(qkv, cos, cos, pos, slots, kc, vc, hq, hkv, d),
        "fused.silu_mul": lambda: fk.silu_mul(gu),
        "F.linear": lambda: F.linear(h, wl),
        "sdpa_causal (views in, [T, Hq*D] out)": lambda: sdpa_causal(q4, k4, k4, d**-0.5),
        "heads_first + 2 cache_heads_first": lambda: (heads_first(q), cache_heads_first(kc, 0, rows),
                                                     cache_heads_first(vc, 0, rows)),
        "F.scaled_dot_product_attention alone": lambda: F.scaled_dot_product_attention(
            q4, k4, k4, is_causal=True, scale=d**-0.5, enable_gqa=hq != hkv),
        "a.view(...) (one view op)": lambda: a.view(rows, hq, d),
        "torch.empty_like": lambda: torch.empty_like(h),
    }
    print(f"\nhost cost per call (us; {n} calls back to back on {rows} rows, GPU work negligible)")
    for name, fn in items.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        print(f"  {name:40s} {(time.perf_counter() - t0) * 1e6 / n:7.1f}")


def profile_one(dec: Decoder, cache: KVCache, ids: torch.Tensor, top: int = 15) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    dec.prefill(ids, 0, cache.k, cache.v)
    torch.cuda.synchronize()
    # a warmup step takes the profiler's own start-up cost (else charged to the first op)
    sched = schedule(wait=0, warmup=1, active=1, repeat=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched) as prof:
            for _ in range(2):
                dec.prefill(ids, 0, cache.k, cache.v)
                torch.cuda.synchronize()
                prof.step()
    avgs = prof.key_averages()
    kernels = [a for a in avgs if a.device_type == DeviceType.CUDA and a.self_device_time_total > 0]
    kernels.sort(key=lambda a: a.self_device_time_total, reverse=True)
    total = sum(a.self_device_time_total for a in kernels)
    n_launch = sum(a.count for a in kernels)
    print(f"\nprofile of one fused prefill: {n_launch} GPU kernels/copies, {total / 1e3:.3f} ms GPU busy")
    print(f"  {'kernel':70s} {'calls':>5s} {'total us':>9s} {'avg us':>7s} {'%':>5s}")
    for a in kernels[:top]:
        name = a.key if len(a.key) <= 70 else a.key[:67] + "..."
        us = a.self_device_time_total
        print(f"  {name:70s} {a.count:5d} {us:9.1f} {us / a.count:7.1f} {100 * us / total:5.1f}")
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU
           and not e.name.startswith("ProfilerStep")]
    # top-level: called by prefill itself (the schedule wraps the step in a ProfilerStep# range)
    top_level = [e for e in cpu if e.cpu_parent is None or e.cpu_parent.name.startswith("ProfilerStep")]
    aten = [e for e in cpu if e.name.startswith("aten::")]
    launches = [e for e in cpu if "LaunchKernel" in e.name or "cuLaunch" in e.name]
    nl = dec.cfg.num_layers
    print(f"  CPU ops: {len(cpu)} events, {len(top_level)} top-level, {len(aten)} aten:: ops, "
          f"{len(launches)} kernel-launch API calls ({len(top_level) / nl:.1f} top-level per layer)")
    names: dict[str, list[float]] = {}
    for e in top_level:
        c = names.setdefault(e.name, [0, 0.0])
        c[0] += 1
        c[1] += e.cpu_time_total
    common = sorted(names.items(), key=lambda kv: -kv[1][1])[:12]
    print("  top-level CPU ops by host time (count, total us): "
          + ", ".join(f"{n} x{c} {us:.0f}" for n, (c, us) in common))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py needs a CUDA device")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    t_start = time.perf_counter()
    m = load_random(args.preset, dev, dtype, 0)
    cfg = m.cfg
    cache = KVCache(cfg, 4096, dev, dtype)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).to(dev)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; {args.preset}: {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, D {cfg.head_dim}; "
          f"prompt {args.tokens} tokens, warmup {args.warmup}, repeats {args.repeats}")
    decs = {fused: Decoder(cfg, m.weights, 4096, fused=fused) for fused in (True, False)}
    print(f"\n  {'path':8s} {'ttft ms':>8s} {'(min)':>7s} {'gpu ms':>8s} {'host ms':>8s} {'piped ms':>9s}")
    results = {}
    for fused, dec in decs.items():
        r = results[fused] = time_prefill(dec, cache, ids, args.warmup, args.repeats)
        print(f"  {'fused' if fused else 'unfused':8s} {r['ttft']:8.3f} {r['ttft_min']:7.3f} {r['gpu']:8.3f} "
              f"{r['host']:8.3f} {r['piped']:9.3f}")
    a = decs[True].prefill(ids, 1, cache.k, cache.v, all_logits=True)
    b = decs[False].prefill(ids, 2, cache.k, cache.v, all_logits=True)
    rel = ((a - b).abs().max() / b.abs().max()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"  fused vs unfused logits: max diff {rel:.2e} of max |logit|, argmax agrees on {100 * agree:.1f}% rows")
    attention_routes(cfg, args.tokens, dtype)
    host_costs(cfg, dtype)
    if not args.no_profile:
        profile_one(decs[True], cache, ids)
    print(f"\ntotal script time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
