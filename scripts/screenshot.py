"""Regenerates assets/screenshot.svg: the app on the embedded default model answering a question;
with --speculate, assets/screenshot-speculation.svg: the same app with prompt-lookup speculation
on, repeating a given paragraph (drafted text marked, acceptance in the panel)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from fgchat.engine.core import EngineConfig
from fgchat.protocol.events import SamplingParams
from fgchat.tui.app import FgchatApp

OUT = Path(__file__).resolve().parent.parent / "assets" / "screenshot.svg"


PARAGRAPH = ("Repeat this paragraph exactly: The quick brown fox jumps over the lazy dog. A CUDA graph "
             "records a sequence of kernel launches once and replays it with a single call, so the host "
             "no longer pays for every launch.")


async def main(question: str, speculate: bool = False) -> None:
    out = OUT.with_name("screenshot-speculation.svg") if speculate else OUT
    questions = (PARAGRAPH,) if speculate else (question, "And of Italy?")
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(model=None, device="cpu", mode="eager", speculate="ngram" if speculate else "off")
        app = FgchatApp(config, sampling=SamplingParams(max_tokens=200), data_path=Path(tmp))
        async with app.run_test(size=(120, 34)) as pilot:
            deadline = time.monotonic() + 120
            while app.link.state == "starting" and time.monotonic() < deadline:
                await pilot.pause(0.1)
            for q in questions:
                n = app.latency.log.request_count
                await app.send_prompt(q)
                while app.latency.log.request_count == n:
                    await pilot.pause(0.1)
            await pilot.pause(0.5)
            app.save_screenshot(filename=out.name, path=str(out.parent))
            app.exit()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--speculate"]
    asyncio.run(main(args[0] if args else "What is the capital of France?", "--speculate" in sys.argv[1:]))
