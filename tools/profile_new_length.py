"""Where an eager fused prefill at a length it has not run before spends its extra time: torch's
profiler over one prefill at a new length and one at a length already run, the ops with the most
host time first (CUDA: needs a GPU). --blas picks torch's BLAS library for the products (cuBLAS
plans each new row count on the host; cuBLASLt's planning may cost less).
Usage: python tools/profile_new_length.py [--model M] [--lengths 2100,2230] [--top 14] [--blas cublaslt]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="2100,2230")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default")
    a = ap.parse_args()
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)

    from torch.profiler import ProfilerActivity, profile

    from fgchat.engine.core import Engine, EngineConfig

    eng = Engine(EngineConfig(model=a.model, device="cuda", mode="eager", max_context=4096, lazy_capture=True))
    dec, k, v = eng.decoder, eng.cache.k, eng.cache.v
    vocab = eng.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    first, second = (int(x) for x in a.lengths.split(","))
    with torch.inference_mode():
        dec.prefill(torch.randint(0, vocab, (first,), generator=g).cuda(), 0, k, v)
        torch.cuda.synchronize()
        for label, n in (("repeated", first), ("new", second)):
            ids = torch.randint(0, vocab, (n,), generator=g).cuda()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                dec.prefill(ids, 1, k, v)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
            print(f"== blas {a.blas}, {label} length {n}: {wall:.1f} ms wall (profiled)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
