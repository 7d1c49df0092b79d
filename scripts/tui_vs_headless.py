"""ITL median while the TUI streams vs the same model and mode headless (engine isolation check).

Builds a SmolLM2-135M-shaped model with a small trained tokenizer (tests/tiny_models.py), then
runs REPS replies of N tokens (FGCHAT_TOKENS, default 256) headless (Engine in this process) and
REPS through the Textual app (engine in its own process, UI rendering in this one), after one
warm-up reply each. Per reply it takes the median inter-token latency (the TUI's from its
latency log, the one the console shows), and prints the medians of both and their ratio.
Needs textual (installed from wheels where there is no network: pip install --no-index
--find-links DIR textual); without it, one line says so.
Batch K > 1: K replies to one prompt (the TUI's F4), sampled at temperature 0.7 in both.
Usage: python scripts/tui_vs_headless.py [mode] [K]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tiny_models  # noqa: E402

from fgchat.engine.core import Engine, EngineConfig  # noqa: E402
from fgchat.protocol.events import RequestFinished, SamplingParams  # noqa: E402

N, REPS = int(os.environ.get("FGCHAT_TOKENS", 256)), 3
PROMPT = "Tell me about latency."


def headless(model: Path, mode: str, k: int) -> list[float]:
    """Median ITL (ms) over the K replies of each round after the warm-up."""
    eng = Engine(EngineConfig(model=str(model), mode=mode, max_context=2048))
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    out = []
    for _ in range(REPS + 1):
        for i in range(k):
            eng.submit(ids, SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.7 if k > 1 else 0.0,
                                           seed=i))
        done = [e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)]
        out.append(statistics.median(x for d in done for x in d.itl_ms))
    return out[1:]


async def with_tui(model: Path, mode: str, data: Path, k: int) -> list[float]:
    from fgchat.tui.app import FgchatApp

    app = FgchatApp(EngineConfig(model=str(model), mode=mode, max_context=2048),
                    sampling=SamplingParams(max_tokens=N, ignore_eos=True), data_path=data)
    async with app.run_test(size=(120, 40)) as pilot:
        deadline = time.monotonic() + 300
        while app.link.state == "starting" and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert app.link.state == "ready", app.link.error
        app.set_samples(k)
        for i in range(REPS + 1):
            await app.send_prompt(PROMPT)
            while app.latency.log.request_count < (i + 1) * k:
                await pilot.pause(0.05)
        log = app.latency.log
        rounds = [[r.request_id for r in log.requests()][j * k:(j + 1) * k] for j in range(REPS + 1)]
        medians = [statistics.median(t.itl_ms for t in log.tokens() if t.request_id in ids and t.itl_ms is not None)
                   for ids in map(set, rounds)]
        app.exit()
    return medians[1:]


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "full"
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    try:
        import textual  # noqa: F401
    except ImportError:
        sys.exit("tui_vs_headless: textual is not installed (pip install textual, or from wheels: "
                 "pip install --no-index --find-links DIR textual)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        model = tiny_models.build_model(Path(tmp) / "m", "llama", hidden=576, layers=30, heads=9,
                                        kv_heads=3, head_dim=64, intermediate=1536, max_pos=8192,
                                        tie=True, dtype="bfloat16")
        h = headless(model, mode, k)
        t = asyncio.run(with_tui(model, mode, Path(tmp) / "data", k))
    hm, tm = statistics.median(h), statistics.median(t)
    print(f"mode {mode} K {k}: headless ITL median {hm:.3f} ms {['%.3f' % x for x in h]}")
    print(f"mode {mode} K {k}: TUI ITL median      {tm:.3f} ms {['%.3f' % x for x in t]}")
    print(f"RESULT mode={mode} k={k} headless_ms={hm:.4f} tui_ms={tm:.4f} ratio={tm / hm:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
