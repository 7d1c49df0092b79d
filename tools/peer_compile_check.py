"""Checks the hf-compile peer compiles its decode step once per batch size and never while timed.

    python tools/peer_compile_check.py                      # CPU, tiny preset, batch 1,2, 2 repeats
    python tools/peer_compile_check.py --device cuda --preset llama-3.2-1b --prompt-len 512 --output-len 128 \\
        --batch-sizes 1,8

Prints, per batch size, the graphs dynamo compiled during warm-up and during the timed repeats (must be 0),
the warm-up seconds and TTFT/TPOT; then checks the compiled peer's greedy tokens equal eager `generate`'s on a
reused, reset cache. Exits 1 if a timed repeat compiled or the tokens differ. Set TORCH_LOGS=recompiles to see why
dynamo recompiled.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch-sizes", default="1,2")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peer-timeout", type=float, default=420.0)
    args = ap.parse_args()

    from fgchat.bench import peers
    from fgchat.bench.spec import BenchSpec, prompts_for

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    spec = BenchSpec(preset=args.preset, batch_sizes=sizes, prompt_len=args.prompt_len,
                     output_len=args.output_len, warmup=args.warmup, repeats=args.repeats,
                     peers=["hf-compile"], device=args.device, dtype=args.dtype)
    spec.peer_timeout = args.peer_timeout  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    runs, skipped = peers.run_hf_peers(spec, None, lambda label: print(f"-- {label}", flush=True))
    wall = time.perf_counter() - t0
    bad = False
    for r in runs:
        print(f"{r['runner']} batch {r['batch_size']}: graphs compiled warm-up {r['graphs_compiled_warmup']}, "
              f"timed {r['graphs_compiled_timed']}; warm-up {r['warmup_s']:.1f} s; "
              f"TTFT {r['ttft_ms']['median']:.2f} ms, TPOT {r['tpot_ms']['mean']:.3f} ms, "
              f"{r['output_tokens_per_s']:.0f} tok/s")
        bad |= r["graphs_compiled_timed"] != 0
    for s in skipped:
        print(f"skipped {s['runner']}: {s['reason']}")
    print(f"peer wall time {wall:.1f} s")
    bad |= bool(skipped) or len(runs) != len(sizes)

    # the compiled, cache-reusing path must produce eager's greedy tokens (float32 makes this exact on CPU)
    if args.device == "cpu" and args.dtype in (None, "float32"):
        from fgchat.engine.devices import pick_device, pick_dtype

        device = pick_device(args.device)
        model = peers._hf_model(spec, device, pick_dtype(args.dtype, device))
        compiled = peers._Compiled(model, spec)
        kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
        for b in sizes:
            ids = torch.tensor(prompts_for(b, args.prompt_len, model.config.vocab_size), device=device)
            with torch.inference_mode():
                ref = model.generate(ids, **kw)
                outs = [model.generate(ids, **kw, **compiled.kwargs(b)) for _ in range(2)]
            same = all(torch.equal(ref, o) for o in outs)
            print(f"batch {b}: compiled tokens equal eager's over 2 calls on one reset cache: {same}")
            bad |= not same
    print("FAIL" if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
