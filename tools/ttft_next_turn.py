"""Time to first token of each turn of a chat, with the engine's prefix reuse on and off
(FGCHAT_PREFIX_REUSE=1 / 0), one fresh process per run, the two alternating round by round.

Each run: the embedded model (or --model) on --device, a system prompt and --turns user messages;
every reply (greedy, --max-tokens) goes back into the conversation, as the TUI does. Prints per
turn the prompt length, the tokens reused and the TTFT, then the medians per setting.
Usage:
    python tools/ttft_next_turn.py [--model M] [--device cpu] [--mode eager] [--rounds 3] [--turns 4]
        [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from alternate import alternating_runs

QUESTIONS = [
    "Tell me about the history of Paris in a few paragraphs.",
    "And what about its food?",
    "Which museums should I visit first?",
    "How do I get around the city?",
    "What is a good day trip from there?",
    "Summarize our conversation in three sentences.",
]


def one_run(a: argparse.Namespace) -> list[dict]:
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams, TokenEvent

    eng = Engine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, mode=a.mode))
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []
    for q in QUESTIONS[: a.turns]:
        msgs.append({"role": "user", "content": q})
        ids = list(eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
        t0 = time.perf_counter()
        first = None
        eng.submit(ids, SamplingParams(max_tokens=a.max_tokens))
        summary = None
        while eng.has_work():
            for ev in eng.step():
                if isinstance(ev, TokenEvent) and first is None:
                    first = time.perf_counter() - t0
                if isinstance(ev, RequestFinished):
                    summary = ev.summary
        out.append({"prompt": len(ids), "cached": summary.cached_tokens, "ttft_ms": first * 1e3})
        msgs.append({"role": "assistant", "content": summary.text})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mode", default=None, help="eager, piecewise or full (the engine's default: full)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one_run(a)))
        return
    runs: dict[str, list[list[dict]]] = {"0": [], "1": []}
    for r, val, line in alternating_runs(__file__, "FGCHAT_PREFIX_REUSE", a.rounds):
        res = json.loads(line)
        runs[val].append(res)
        print(f"round {r} reuse={val}: " + "  ".join(
            f"turn {i + 1}: {t['prompt']} tok, {t['cached']} reused, {t['ttft_ms']:.1f} ms" for i, t in enumerate(res)))
    for val, rs in runs.items():
        med = [statistics.median(run[i]["ttft_ms"] for run in rs) for i in range(a.turns)]
        print(f"FGCHAT_PREFIX_REUSE={val}: TTFT median per turn " + " / ".join(f"{m:.1f}" for m in med) + " ms")


if __name__ == "__main__":
    main()
