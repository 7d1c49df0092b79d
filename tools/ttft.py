"""Time to first token (TTFT) of the engine, one case per subcommand: `turns`: each turn of a chat
whose replies go back into the conversation, as the TUI sends it (prefix reuse shows in the later
turns); `long`: prompts past the last prefill bucket, each at a new length, then the first length
again (per-shape preparation shows in the new lengths only); `batch`: K prompts admitted together,
identical (one shared prefill) against distinct (one pass), alternating round by round; `parts`
(CUDA): a full-mode TTFT taken apart: engine TTFT against its prefill graph's replay, and from one
profiled admission the kernels' sum, span and gaps and the host time around them. Round 0 of each
case warms up and is not counted. The model: --model (a GGUF or folder), --preset (random weights)
or, with neither, the embedded SmolLM2-135M-Instruct.

    python tools/ttft.py turns --device cpu --turns 5
    python tools/ttft.py long --device cuda --modes eager,full
    python tools/ttft.py batch --preset llama-3.2-1b --k 8 --prompt-len 512
    python tools/ttft.py parts --preset llama-3.2-1b --k 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

QUESTIONS = [
    "Tell me about the history of Paris in a few paragraphs.",
    "And what about its food?",
    "Which museums should I visit first?",
    "How do I get around the city?",
    "What is a good day trip from there?",
    "Summarize our conversation in three sentences.",
]


def make_engine(a: argparse.Namespace, mode: str | None = None, max_context: int | None = None):
    from fgchat.engine.core import Engine, EngineConfig

    kw = {"max_context": max_context} if max_context else {}
    return Engine(EngineConfig(model=a.model, preset=a.preset, device=a.device, dtype=a.dtype,
                               mode=mode or a.mode, **kw))


def admit(eng, prompts: list[list[int]], max_tokens: int = 2) -> tuple[list[float], list]:  # noqa: ANN001
    """Submit the prompts together, run them to the end: ms from submit to each first token (in the
    order they came) and the requests' summaries. Replies of the default 2 tokens ignore EOS."""
    from fgchat.protocol.events import RequestFinished, SamplingParams, TokenEvent

    t0 = time.perf_counter()
    for ids in prompts:
        eng.submit(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=max_tokens <= 2))
    firsts, done = [], []
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, TokenEvent) and ev.is_first_token:
                firsts.append((time.perf_counter() - t0) * 1e3)
            elif isinstance(ev, RequestFinished):
                done.append(ev.summary)
    return firsts, done


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def case_turns(a: argparse.Namespace) -> None:
    eng = make_engine(a)
    per_turn: list[list[float]] = [[] for _ in range(a.turns)]
    for rnd in range(a.rounds + 1):
        # the round first in the system prompt: a round reuses no earlier round's chat
        msgs = [{"role": "system", "content": f"Round {rnd}. You are a helpful assistant."}]
        cells = []
        for i, q in enumerate(QUESTIONS[: a.turns]):
            msgs.append({"role": "user", "content": q})
            ids = list(eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
            (ms,), (summary,) = admit(eng, [ids], a.max_tokens)
            msgs.append({"role": "assistant", "content": summary.text})
            cells.append(f"turn {i + 1}: {len(ids)} tok, {summary.cached_tokens} reused, {ms:.1f} ms")
            if rnd:
                per_turn[i].append(ms)
        print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: " + "  ".join(cells), flush=True)
    print("TTFT median per turn: " + " / ".join(f"{statistics.median(x):.1f}" for x in per_turn) + " ms")


def case_long(a: argparse.Namespace) -> None:
    lengths = [int(x) for x in a.lengths.split(",")]
    modes = a.modes.split(",")
    eng = make_engine(a, mode=modes[0], max_context=a.context)
    rng = random.Random(0)
    vocab = eng.cfg.vocab_size
    for mode in modes:
        eng.set_mode(mode)
        admit(eng, [random_ids(rng, 64, vocab)])  # the mode's own first request
        new = [admit(eng, [random_ids(rng, t, vocab)])[0][0] for t in lengths]
        again = admit(eng, [random_ids(rng, lengths[0], vocab)])[0][0]
        print(f"{mode:<9} new lengths " + " / ".join(f"{t}: {ms:.1f}" for t, ms in zip(lengths, new))
              + f" ms | median {statistics.median(new):.1f} ms | {lengths[0]} again: {again:.1f} ms")


def case_batch(a: argparse.Namespace) -> None:
    eng = make_engine(a, max_context=a.prompt_len + 64)
    vocab, n, k = eng.cfg.vocab_size, a.prompt_len, a.k
    variants = {  # random prompts of their own each round: nothing is reused from an earlier round
        "identical (shared prefill)": lambda rng: [random_ids(rng, n, vocab)] * k,
        "distinct (one pass)": lambda rng: [random_ids(rng, n, vocab) for _ in range(k)],
    }
    res: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(a.rounds + 1):
        names = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
        for name in names:
            firsts, _ = admit(eng, variants[name](random.Random(f"{rnd} {name}")))
            if rnd:
                res[name].append(statistics.mean(firsts))
    info = eng.info()
    print(f"{info.model_name} on {info.device}, {info.dtype}: {k} prompts of {n} tokens, "
          f"median over {a.rounds} rounds of the round's mean TTFT")
    for name, xs in res.items():
        print(f"  {name:28s} {statistics.median(xs):9.2f} ms   {['%.2f' % x for x in xs]}")


def trace_admission(eng, prompts: list[list[int]]) -> dict:  # noqa: ANN001
    """One admission under torch's profiler: kernel count, sum and span, host time around them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fgchat.protocol.events import SamplingParams, TokenEvent

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("admission"):
            for ids in prompts:
                eng.submit(ids, SamplingParams(max_tokens=1, ignore_eos=True))
            firsts = 0
            while firsts < len(prompts):
                firsts += sum(isinstance(ev, TokenEvent) and ev.is_first_token for ev in eng.step())
    while eng.has_work():
        eng.step()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f)["traceEvents"]
    kernels = sorted((e for e in evs if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    outer = next(e for e in evs if e.get("name") == "admission" and e.get("ph") == "X")
    start, end = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
    busy = sum(k["dur"] for k in kernels)
    return {
        "kernels": len(kernels), "kernel_sum_ms": busy / 1e3, "span_ms": (end - start) / 1e3,
        "gaps_ms": (end - start - busy) / 1e3, "host_before_ms": (start - outer["ts"]) / 1e3,
        "host_after_ms": (outer["ts"] + outer["dur"] - end) / 1e3, "admission_ms": outer["dur"] / 1e3,
        "largest": sorted(((k["dur"], k["name"][:60]) for k in kernels), reverse=True)[:6],
        "widest_gaps": sorted(((b["ts"] - a["ts"] - a["dur"], f"{a['name'][:40]} -> {b['name'][:40]}")
                               for a, b in zip(kernels, kernels[1:])), reverse=True)[:8],
        "slowest_runtime_calls": sorted(((e["dur"], e["name"][:60]) for e in evs if e.get("cat") == "cuda_runtime"
                                         and e["ts"] >= outer["ts"]), reverse=True)[:8],
    }


def case_parts(a: argparse.Namespace) -> None:
    import torch

    from fgchat.engine.heap import freeze_heap
    from fgchat.protocol.events import Mode

    if not torch.cuda.is_available():
        sys.exit("ttft parts: needs a CUDA GPU")
    a.device = "cuda"
    eng = make_engine(a, mode=Mode.FULL, max_context=max(1024, a.prompt_len + 64))
    freeze_heap(collect=True)
    rng = random.Random(0)
    prompts = [random_ids(rng, a.prompt_len, eng.cfg.vocab_size - 100) for _ in range(a.k)]
    dev_ids = torch.tensor(prompts[0], device="cuda")
    ttft, wall, gpu = [], [], []
    for rnd in range(a.rounds + 1):
        # fresh prompts each round: none starts with tokens a cache slot still holds
        fresh = [random_ids(rng, a.prompt_len, eng.cfg.vocab_size - 100) for _ in range(a.k)]
        last = max(admit(eng, fresh)[0])
        if rnd == 0:
            continue
        ttft.append(last)
        if a.k > 1:
            continue
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            t0 = time.perf_counter()
            e0.record()
            eng.modes.prefill_logits(Mode.FULL, dev_ids, 0, greedy=True)
            e1.record()
            torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(e0.elapsed_time(e1))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; {a.model or a.preset or 'embedded'}, "
          f"full mode, {a.prompt_len}-token prompt x {a.k}, {a.rounds} rounds")
    rows = (("engine ttft", ttft), ("graph wall", wall), ("graph gpu", gpu)) if a.k == 1 else (("engine ttft", ttft),)
    for label, xs in rows:
        print(f"  {label:<12} median {statistics.median(xs):7.3f} ms  min {min(xs):7.3f}")
    tr = trace_admission(eng, prompts)
    print("one traced admission (profiler on: host times inflate):")
    lists = ("largest", "widest_gaps", "slowest_runtime_calls")
    for key, v in tr.items():
        if key not in lists:
            print(f"  {key:<15} {v:8.3f}" if isinstance(v, float) else f"  {key:<15} {v}")
    for key in lists:
        print(f"  {key.replace('_', ' ')}:")
        for dur, what in tr[key]:
            print(f"    {dur / 1e3:7.3f} ms  {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", help="a GGUF file or model folder (default: the embedded model)")
    common.add_argument("--preset", help="a preset's shape with random weights, instead of --model")
    common.add_argument("--device", help="cpu or cuda (default: the engine's choice)")
    common.add_argument("--dtype", default="auto")
    common.add_argument("--mode", help="eager, piecewise, full or mega (default: the engine's)")
    common.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up (default 3)")
    sub = ap.add_subparsers(dest="case", required=True, metavar="CASE")
    p = sub.add_parser("turns", parents=[common], help="each turn of a chat, replies fed back")
    p.add_argument("--turns", type=int, default=4, choices=range(1, len(QUESTIONS) + 1), metavar="1-6")
    p.add_argument("--max-tokens", type=int, default=200, help="reply length cap (default 200)")
    p = sub.add_parser("long", parents=[common], help="prompts past the last bucket, each at a new length")
    p.add_argument("--modes", default="eager,full")
    p.add_argument("--lengths", default="2100,2230,2410,2650,3000")
    p.add_argument("--context", type=int, default=4096)
    p = sub.add_parser("batch", parents=[common], help="K prompts admitted together: identical vs distinct")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p = sub.add_parser("parts", parents=[common], help="CUDA: a full-mode TTFT taken apart")
    p.add_argument("--k", type=int, default=1, help="distinct prompts admitted together")
    p.add_argument("--prompt-len", type=int, default=512)
    a = ap.parse_args()
    if a.model and a.preset:
        ap.error("--model and --preset: give one")
    if a.rounds < 1 or getattr(a, "k", 1) < 1 or getattr(a, "prompt_len", 1) < 1:
        ap.error("--rounds, --k and --prompt-len must be >= 1")
    if a.case == "long" and max(int(x) for x in a.lengths.split(",")) + 8 > a.context:
        ap.error("--lengths must fit in --context")
    {"turns": case_turns, "long": case_long, "batch": case_batch, "parts": case_parts}[a.case](a)


if __name__ == "__main__":
    main()
