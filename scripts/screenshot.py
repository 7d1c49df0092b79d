"""Regenerates assets/screenshot.svg: the app on the embedded default model answering a question."""

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


async def main(question: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        app = FgchatApp(EngineConfig(model=None, device="cpu", mode="eager"),
                        sampling=SamplingParams(max_tokens=200), data_path=Path(tmp))
        async with app.run_test(size=(120, 34)) as pilot:
            deadline = time.monotonic() + 120
            while app.link.state == "starting" and time.monotonic() < deadline:
                await pilot.pause(0.1)
            for q in (question, "And of Italy?"):
                n = app.latency.log.request_count
                await app.send_prompt(q)
                while app.latency.log.request_count == n:
                    await pilot.pause(0.1)
            await pilot.pause(0.5)
            app.save_screenshot(filename=OUT.name, path=str(OUT.parent))
            app.exit()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"))
