"""GPU micro-benchmark of the decode-attention backends at Llama-3.2-1B shapes.

Shapes: Hq=32, Hkv=8, D=64, bf16, 8 cache slots x T=8192, batch 1 and 8, lengths 512/2048/8192.
What is timed: one CUDA graph holding one attention call per layer for LAYERS distinct layer
caches (as in the `full` mode), replayed by triton.testing.do_bench, which flushes L2 before
every replay; the figure is that time / LAYERS, i.e. GPU time of one layer's attention with a
cold cache and no launch overhead. `eager` columns time a single Python-launched call instead
(launch overhead included, L2 flushed likewise).

    python tools/bench_attention.py            # backends side by side
    python tools/bench_attention.py --sweep    # also the triton tuning variants
    python tools/bench_attention.py --sweep --head-dim 128
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import triton.testing

from fgchat.engine.kernels.attention.torch_ref import TorchDecodeAttention
from fgchat.engine.kernels.attention.triton_decode import KernelConfig, TritonDecodeAttention

NUM_Q_HEADS, NUM_KV_HEADS, SLOTS, MAX_CONTEXT, LAYERS = 32, 8, 8, 8192, 16
HEAD_DIM = 64  # --head-dim 128 gives Llama-3.1-8B's attention shapes
BATCHES, LENGTHS = (1, 8), (512, 2048, 8192)
DTYPE = torch.bfloat16

Backend = Callable[..., None]


def make_layers(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (SLOTS, MAX_CONTEXT, NUM_KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, device=device, dtype=DTYPE), torch.randn(shape, device=device, dtype=DTYPE)) for _ in range(LAYERS)]


def time_graph_ms(backend: Backend, layers: list, q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> float:
    """Per-layer GPU time (ms) of `backend` replayed inside one CUDA graph over all layers."""
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    def step() -> None:
        for k_cache, v_cache in layers:
            backend(q, k_cache, v_cache, slots, lens, out, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile / warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms / len(layers)


def time_eager_ms(backend: Backend, layers: list, q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, hint: int | None) -> float:
    out = torch.empty_like(q)
    k_cache, v_cache = layers[0]
    scale = 1.0 / math.sqrt(HEAD_DIM)
    return triton.testing.do_bench(
        lambda: backend(q, k_cache, v_cache, slots, lens, out, scale, hint), warmup=25, rep=200, return_mode="median"
    )


def kv_bytes(batch: int, length: int) -> int:
    return 2 * batch * length * NUM_KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time triton tuning variants")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=64)
    args = parser.parse_args()
    global HEAD_DIM
    HEAD_DIM = args.head_dim

    if not torch.cuda.is_available():
        raise SystemExit("bench_attention: needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} {DTYPE} T={MAX_CONTEXT}; per-layer ms, graph of {LAYERS} layers, L2 flushed")
    layers = make_layers(device)

    backends: dict[str, Backend] = {"triton": TritonDecodeAttention(device), "torch": TorchDecodeAttention()}
    try:
        from fgchat.engine.kernels.attention.flash import FlashAttnDecode

        backends["flash-attn"] = FlashAttnDecode(device)
    except Exception as exc:  # optional: report and go on
        print(f"# flash-attn skipped: {exc}")

    triton_backend = backends["triton"]
    assert isinstance(triton_backend, TritonDecodeAttention)
    header = ["batch", "len", "programs", "chunks"] + [f"{name}_ms" for name in backends] + ["triton_eager_ms", "torch_eager_hint_ms", "triton_GBps", "torch/triton"]
    if "flash-attn" in backends:
        header.append("flash/triton")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for batch in BATCHES:
        for length in LENGTHS:
            q = torch.randn((batch, NUM_Q_HEADS, HEAD_DIM), device=device, dtype=DTYPE)
            slots = torch.arange(batch, device=device, dtype=torch.int32)
            lens = torch.full((batch,), length, device=device, dtype=torch.int32)
            ms = {name: time_graph_ms(b, layers, q, slots, lens) for name, b in backends.items()}
            triton_eager = time_eager_ms(triton_backend, layers, q, slots, lens, None)
            torch_eager = time_eager_ms(backends["torch"], layers, q, slots, lens, length)
            # programs per (lane, kv head) at this batch; chunks: the fixed partition of every lane
            row = [str(batch), str(length), str(triton_backend.num_splits(batch, NUM_KV_HEADS, MAX_CONTEXT, HEAD_DIM)),
                   str(triton_backend.partition(NUM_KV_HEADS, MAX_CONTEXT, HEAD_DIM))]
            row += [f"{ms[name]:.4f}" for name in backends]
            row += [f"{triton_eager:.4f}", f"{torch_eager:.4f}", f"{kv_bytes(batch, length) / ms['triton'] / 1e6:.0f}"]
            row.append(f"{ms['torch'] / ms['triton']:.1f}")
            if "flash-attn" in ms:
                row.append(f"{ms['flash-attn'] / ms['triton']:.2f}")
            print("| " + " | ".join(row) + " |", flush=True)

    if not args.sweep:
        return
    variants: dict[str, KernelConfig | None] = {
        "default": None,
        "N32 w2 s2": KernelConfig(32, 2, 2),
        "N64 w4 s2": KernelConfig(64, 4, 2),
        "N64 w4 s3": KernelConfig(64, 4, 3),
        "N64 w4 s4": KernelConfig(64, 4, 4),
        "N128 w4 s2": KernelConfig(128, 4, 2),
        "N128 w4 s3": KernelConfig(128, 4, 3),
        "N128 w8 s3": KernelConfig(128, 8, 3),
        "N64 w4 s3 pps4": KernelConfig(64, 4, 3, programs_per_sm=4),
        "N128 w4 s3 pps4": KernelConfig(128, 4, 3, programs_per_sm=4),
        "N64 w4 s3 pps1": KernelConfig(64, 4, 3, programs_per_sm=1),
        "no split (max_splits=1)": KernelConfig(64, 4, 2, max_splits=1),
    }
    print("\n| variant | " + " | ".join(f"b{b} L{n}" for b in BATCHES for n in LENGTHS) + " |")
    print("|---|" + "---|" * (len(BATCHES) * len(LENGTHS)))
    for label, config in variants.items():
        variant = TritonDecodeAttention(device, config)
        cells = []
        for batch in BATCHES:
            for length in LENGTHS:
                q = torch.randn((batch, NUM_Q_HEADS, HEAD_DIM), device=device, dtype=DTYPE)
                slots = torch.arange(batch, device=device, dtype=torch.int32)
                lens = torch.full((batch,), length, device=device, dtype=torch.int32)
                try:
                    cells.append(f"{time_graph_ms(variant, layers, q, slots, lens):.4f}")
                except Exception as exc:  # e.g. a config that needs more shared memory than the SM has
                    cells.append(f"failed: {type(exc).__name__}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
