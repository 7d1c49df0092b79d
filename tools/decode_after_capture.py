"""Which later CUDA-graph capture slows the decode graphs' replays (notes V19, V78): the decode
step's GPU time (the engine's per-step CUDA events) before and after one action, in one process.

The engine starts with no prefill graphs and prompts prefilled eagerly one by one
(FGCHAT_PREFILL_GRAPHS=0, FGCHAT_PREFILL_BATCH_ROUTE=0), so nothing is captured after the decode
graphs until the action. Actions (--action; one per process, alternate them across runs):
  none           nothing (the control: drift between the two measurements)
  empty-cache    torch.cuda.empty_cache() alone (every capture's report starts with one)
  dummy          a graph of one elementwise kernel captured on the capture stream, the shared pool
  dummy-own      the same in a pool of its own
  cublas         a graph of one cuBLAS product (512 x H by H x H) captured on the capture stream
  cublas-eager   that product run eagerly on the capture stream, no capture
  prefill        the one-prompt prefill graph of 512 tokens, captured and replayed (PrefillGraphs)
  batch          the batch route's graph of 2 x 512, captured on first use as the engine does (a
                 bucket past BATCH_MAX_T is refused by batch_bucket, not by run_batch)
  batch-upload   batch, then every full-mode decode graph uploaded again (cuGraphUpload on the
                 capture stream): whether a later graph costs the decode graphs their upload
  batch-recapture, dummy-recapture   batch / dummy, then the full-mode decode graphs dropped and
                 captured again: whether graphs captured after the action run at full speed
  batch-idle     the batch route's graph captured through the engine, then the engine's idle
                 passes (Engine.capture_idle: the decode graphs captured again, V85)
Prints the median decode GPU ms per step (batch --batch, --tokens per request) of --rounds
rounds before and after the action, and the change.

Usage: python tools/decode_after_capture.py --action prefill [--preset smollm2-135m] [--batch 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FGCHAT_PREFILL_GRAPHS", "0")
os.environ.setdefault("FGCHAT_PREFILL_BATCH_ROUTE", "0")

import torch  # noqa: E402

ACTIONS = ("none", "empty-cache", "dummy", "dummy-own", "cublas", "cublas-eager", "prefill", "batch",
           "batch-upload", "batch-recapture", "dummy-recapture", "batch-idle")


def decode_gpu_ms(eng, batch: int, tokens: int, rounds: int) -> float:  # noqa: ANN001
    """Median GPU ms of the decode steps of `rounds` rounds of `batch` requests."""
    from fgchat.protocol.events import SamplingParams, TokenEvent

    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(rounds):
        for _ in range(batch):
            ids = torch.randint(100, eng.cfg.vocab_size - 100, (64,), generator=g).tolist()
            eng.submit(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
        steps += [e.gpu_step_ms for e in eng.run_until_done()
                  if isinstance(e, TokenEvent) and not e.is_first_token and e.gpu_step_ms is not None]
    return statistics.median(steps)


def act(eng, action: str, batch_len: int = 200) -> None:  # noqa: ANN001
    import torch.nn.functional as F

    from fgchat.protocol.events import SamplingParams

    from fgchat.engine.modes.capture import GraphCapture
    from fgchat.engine.modes.prefill_graphs import PrefillGraphs

    cap: GraphCapture = eng.modes.cap
    dec = eng.decoder
    hidden = eng.cfg.hidden_size
    torch.cuda.synchronize()
    if action == "batch-idle":
        from fgchat.engine.model.prefill import batch_bucket

        g = torch.Generator().manual_seed(3)
        for _ in range(2):  # two prompts admitted together: the batch route (200 tokens: 2 x 256)
            eng.submit(torch.randint(100, eng.cfg.vocab_size - 100, (batch_len,), generator=g).tolist(),
                       SamplingParams(max_tokens=2, ignore_eos=True))
        eng.run_until_done()
        print("batch route graphs", sorted(eng.modes.prefill_graphs.batch_graphs), "bucket",
              batch_bucket([batch_len] * 2, eng.max_context), "stale", eng.modes.decode_stale())
        longest = 0.0
        while True:  # the longest idle pass: how long a request sent meanwhile would wait
            t = time.perf_counter()
            if not eng.capture_idle():
                break
            longest = max(longest, time.perf_counter() - t)
        print(f"longest idle pass {longest * 1e3:.0f} ms")
        return
    if action.endswith("-recapture"):
        from fgchat.protocol.events import Mode

        act(eng, action.removesuffix("-recapture"))
        full = eng.modes.modes[Mode.FULL]
        sizes = sorted({b for b, _ in full.graphs})
        full.drop()
        eng.capture_sizes("full", sizes)
        return
    if action == "empty-cache":
        torch.cuda.empty_cache()
    elif action in ("dummy", "dummy-own"):
        x = torch.zeros(1 << 20, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=cap.pool if action == "dummy" else None, stream=cap.stream):
            y = x * 2 + 1
        g.replay()
        eng._keep = (g, x, y)
    elif action in ("cublas", "cublas-eager"):
        a = torch.randn(512, hidden, device="cuda", dtype=dec.w.embed.dtype)
        w = torch.randn(hidden, hidden, device="cuda", dtype=dec.w.embed.dtype)
        with torch.cuda.stream(cap.stream):
            F.linear(a, w)
        cap.stream.synchronize()
        if action == "cublas":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=cap.pool, stream=cap.stream):
                y = F.linear(a, w)
            g.replay()
            eng._keep = (g, a, w, y)
    elif action in ("prefill", "batch", "batch-upload"):  # as the engine captures on first use: PrefillGraphs' own path
        graphs = PrefillGraphs(dec, eng.cache.k, eng.cache.v, cap)
        prompt = torch.zeros(512, dtype=torch.int64, device="cuda")
        if action == "prefill":
            graphs.run(prompt, 0)
        else:
            graphs.run_batch([(prompt, 0), (prompt, 1)], 512)
        eng._keep = graphs
        if action == "batch-upload":
            upload_decode_graphs(eng)
    torch.cuda.synchronize()


def upload_decode_graphs(eng) -> None:  # noqa: ANN001
    """Every full-mode decode graph uploaded again on the capture stream (cuGraphUpload, the
    driver call torch does not offer)."""
    from fgchat.engine.cuda_driver import upload_graph_execs
    from fgchat.protocol.events import Mode

    cap = eng.modes.cap
    upload_graph_execs([g.graph.raw_cuda_graph_exec() for g in eng.modes.modes[Mode.FULL].graphs.values()],
                       cap.stream.cuda_stream)
    cap.stream.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--action", choices=ACTIONS, required=True)
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-len", type=int, default=200, help="batch-idle: the two prompts' length")
    a = ap.parse_args()

    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.heap import freeze_heap
    from fgchat.protocol.events import Mode

    eng = Engine(EngineConfig(model=a.model, preset=None if a.model else a.preset, device="cuda",
                              mode=Mode.FULL, max_context=1024))
    eng.capture_sizes("full", [a.batch])
    freeze_heap(collect=True)
    decode_gpu_ms(eng, a.batch, a.tokens, 1)  # warm-up
    while a.action == "batch-idle" and eng.capture_idle():  # the warm-up's own first-use captures
        pass
    before = decode_gpu_ms(eng, a.batch, a.tokens, a.rounds)
    act(eng, a.action, a.batch_len)
    after = decode_gpu_ms(eng, a.batch, a.tokens, a.rounds)
    print(f"{a.model or a.preset} b{a.batch} action {a.action:<13} decode GPU ms/step before {before:.4f} "
          f"after {after:.4f} change {(after - before) * 1e3:+.1f} us ({after / before - 1:+.2%})")


if __name__ == "__main__":
    main()
