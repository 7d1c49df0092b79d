"""Can the TUI keep up with a GPU-rate token stream? Drives FgchatApp (headless, Textual's
run_test) against a fake engine that emits tokens at a fixed inter-token latency, and prints per
round what the UI process paid for it.

The fake engine is EngineProcess with another child: that child sends each decode step's K
TokenEvents as one batch through EngineProcess's pipe (the real child gathers steps for up to
8 ms, so this is the harder case), and the UI process pays for receiving and unpickling them as
it would with the real engine; the child's own CPU is not counted. Each prompt
asks for K replies of --tokens tokens each, one step every --itl-ms; the text is words with a
paragraph break every 48 tokens (a growing Markdown document, as a chat reply is). Each round
runs in a new chat tab (--same-chat: all in one, which then grows round by round).

Per round it prints:
- wall: from sending the prompt to the last reply shown as finished, next to the stream's own
  duration (first to last token, as the engine stamped them);
- cpu/token: CPU time of the whole UI process (every thread) over the round, per token;
- behind: how long after the engine stamped the last token the UI recorded it in the latency
  log (the display's lag at the stream's end), and the largest such lag of any batch;
- msgs: EngineEvents messages the poll thread posted (each one a pass of the UI's handler);
- layouts: full-screen layouts (`Screen._refresh_layout`) during the round, and the median UI
  thread time of one;
- widgets: the widgets on the screen (the compositor's map) when the round ended.

Headless: the compositor renders every frame but nothing is written to a terminal, so the cost
of a real terminal's output is not included.

Usage: python tools/tui_stream_load.py [--itl-ms 3] [--tokens 256] [--k 8] [--rounds 3]
       [--device-name cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from fgchat.engine.core import EngineConfig
from fgchat.engine.commands import Shutdown, SubmitChats
from fgchat.engine.process import EngineProcess
from fgchat.protocol.events import (
    EngineInfo,
    Mode,
    RequestFinished,
    RequestSummary,
    SamplingParams,
    TokenEvent,
)
from fgchat.tui.app import FgchatApp

WORDS = ("the", "latency", "of", "a", "decode", "step", "is", "mostly", "kernel", "launches", "and",
         "memory", "reads", "so", "graphs", "help")
PARAGRAPH = 48  # tokens per paragraph of the generated text


def token_text(i: int) -> str:
    """The i-th token's text: a word, a paragraph break after every PARAGRAPH tokens."""
    word = WORDS[i % len(WORDS)]
    text = word.capitalize() if i % PARAGRAPH == 0 else f" {word}"
    return text + (".\n\n" if i % PARAGRAPH == PARAGRAPH - 1 else "")


def _engine_main(commands, events, itl_ms: float, tokens: int, device: str) -> None:
    """Child process: EngineInfo, then a paced stream for each SubmitChats, until Shutdown."""
    events.send([EngineInfo(model_name="paced", architecture="llama", device=device, dtype="bfloat16",
                            max_context=4096, num_layers=16, attention_backend="triton",
                            available_modes={}, mode=Mode.FULL)])
    step_ns = int(itl_ms * 1e6)
    while True:
        cmd = commands.get()
        if isinstance(cmd, Shutdown):
            return
        if not isinstance(cmd, SubmitChats):
            continue
        rids = [rid for rid, _params in cmd.requests]
        k = len(rids)
        t0 = time.monotonic_ns()
        for i in range(tokens):
            delay = t0 + i * step_ns - time.monotonic_ns()
            if delay > 0:
                time.sleep(delay / 1e9)
            now = time.monotonic_ns()
            first = i == 0
            events.send([TokenEvent(
                request_id=rid, token_index=i, token_id=5 + i, text=token_text(i), mode=Mode.FULL,
                batch_size=k, t_ns=now, itl_ms=None if first else itl_ms, gpu_step_ms=itl_ms * 0.9,
                is_first_token=first, position=10 + i, graph=f"full/b{k}",
                launch_ms=None if first else 0.02,
            ) for rid in rids])
        text = "".join(token_text(i) for i in range(tokens))
        e2e = 3.0 + itl_ms * (tokens - 1)
        events.send([RequestFinished(RequestSummary(
            request_id=rid, prompt_tokens=10, output_tokens=tokens, ttft_ms=3.0,
            tpot_ms=itl_ms if tokens > 1 else None, e2e_ms=e2e, finish_reason="length", text=text,
        )) for rid in rids])


class PacedEngine(EngineProcess):
    """EngineProcess with `_engine_main` as its child instead of the engine: the UI side (command
    queue, event pipe, receiving, shutdown) is EngineProcess's own."""

    def __init__(self, itl_ms: float, tokens: int, device: str) -> None:
        super().__init__(config=EngineConfig(model="paced"))  # the child never reads it
        self.stream = (itl_ms, tokens, device)

    def _start(self) -> None:
        self._commands = self._ctx.Queue()
        self._reader, writer = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=_engine_main, args=(self._commands, writer, *self.stream),
                                       name="paced-engine", daemon=True)
        self._proc.start()
        writer.close()


class RoundProbe:
    """Watches one app's handler from the outside (works with any version of the UI): when each
    batch of tokens was recorded, how many EngineEvents were posted, when the replies ended."""

    def __init__(self, app) -> None:
        self.app = app
        self.messages = 0
        self.last_t_ns = 0  # engine stamp of the newest token recorded
        self.recorded_at_ns = 0  # when the UI recorded it
        self.max_behind_ns = 0
        self.done = asyncio.Event()
        self.layout_s: list[float] = []  # UI thread time of each screen layout this round
        record, finish, post = app.latency.record_tokens, app.replies.finish, app.post_message
        screen = app.screen
        refresh_layout = screen._refresh_layout

        def record_tokens(tokens, *args, **kwargs):
            record(tokens, *args, **kwargs)
            if tokens:
                now = time.monotonic_ns()
                self.max_behind_ns = max(self.max_behind_ns, now - min(ev.t_ns for ev in tokens))
                self.last_t_ns = max(self.last_t_ns, max(ev.t_ns for ev in tokens))
                self.recorded_at_ns = now

        async def finish_reply(summary):
            await finish(summary)
            if not app.replies:
                self.done.set()

        def post_message(message) -> bool:
            if type(message).__name__ == "EngineEvents":
                self.messages += 1
            return post(message)

        def timed_layout(*args, **kwargs):
            started = time.thread_time()
            refresh_layout(*args, **kwargs)
            self.layout_s.append(time.thread_time() - started)

        app.latency.record_tokens = record_tokens
        app.replies.finish = finish_reply
        app.post_message = post_message
        screen._refresh_layout = timed_layout

    def reset(self) -> None:
        self.messages = 0
        self.max_behind_ns = 0
        self.layout_s = []
        self.done.clear()


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    handle = PacedEngine(args.itl_ms, args.tokens, args.device_name)
    data = Path(tempfile.mkdtemp(prefix="fgchat-load-"))
    app = FgchatApp(EngineConfig(model="paced"), engine_factory=lambda cfg: handle, data_path=data,
                    sampling=SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    rows: list[dict[str, float]] = []
    async with app.run_test(size=(args.width, args.height)) as pilot:
        deadline = time.monotonic() + 30
        while app.link.state == "starting":
            if time.monotonic() > deadline:
                raise SystemExit("the fake engine did not start (its child process failed?)")
            await pilot.pause(0.05)
        app.set_samples(args.k)
        probe = RoundProbe(app)
        await pilot.pause(0.5)  # notifications and first layout settle
        for i in range(args.rounds):
            probe.reset()
            if i and not args.same_chat:
                await app.action_chat("new_chat")  # rounds start alike (a long chat lays out slower)
                await pilot.pause(0.3)
            first_count = app.latency.log.token_count
            cpu0, ui0, wall0 = time.process_time(), time.thread_time(), time.monotonic_ns()
            await app.send_prompt(f"prompt {i}")
            await asyncio.wait_for(probe.done.wait(), timeout=60 + args.tokens * args.itl_ms / 100)
            wall_ns = time.monotonic_ns() - wall0
            cpu = time.process_time() - cpu0
            ui_cpu = time.thread_time() - ui0  # the event loop's thread: the UI proper
            tokens = app.latency.log.tokens_since(first_count)
            stream_ms = (max(t.t_ms for t in tokens) - min(t.t_ms for t in tokens)) if tokens else 0.0
            row = dict(wall_ms=wall_ns / 1e6, stream_ms=stream_ms, cpu_us=1e6 * cpu / max(1, len(tokens)),
                       ui_us=1e6 * ui_cpu / max(1, len(tokens)),
                       behind_ms=(probe.recorded_at_ns - probe.last_t_ns) / 1e6,
                       max_behind_ms=probe.max_behind_ns / 1e6, msgs=probe.messages, tokens=len(tokens),
                       layouts=len(probe.layout_s),
                       layout_ms=1e3 * statistics.median(probe.layout_s) if probe.layout_s else 0.0,
                       widgets=len(app.screen._compositor.widgets))
            rows.append(row)
            print(f"round {i}: wall {row['wall_ms']:7.0f} ms (stream {stream_ms:6.0f} ms)  "
                  f"cpu/token {row['cpu_us']:5.0f} us (UI thread {row['ui_us']:5.0f})  behind {row['behind_ms']:6.1f} ms "
                  f"(max {row['max_behind_ms']:6.1f})  msgs {probe.messages:5d}  tokens {len(tokens)}  "
                  f"layouts {row['layouts']:3d} ({row['layout_ms']:5.1f} ms)  widgets {row['widgets']}",
                  flush=True)
            await pilot.pause(0.3)
        app.exit()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--itl-ms", type=float, default=3.0, help="time between decode steps")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per reply")
    parser.add_argument("--k", type=int, default=8, help="replies per prompt (1..8), one batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--same-chat", action="store_true",
                        help="every round in the first chat (it grows) instead of a new chat each")
    parser.add_argument("--width", type=int, default=160, help="terminal size of the headless app")
    parser.add_argument("--height", type=int, default=48)
    parser.add_argument("--device-name", default="NVIDIA H200",
                        help="the device the fake engine reports ('cpu': the UI paces itself as beside a CPU engine)")
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    if len(rows) > 1:
        later = rows[1:]  # the first round also pays for first-use imports and layouts
        print(f"median of rounds 1..: wall {statistics.median(r['wall_ms'] for r in later):.0f} ms, "
              f"cpu/token {statistics.median(r['cpu_us'] for r in later):.0f} us, "
              f"behind {statistics.median(r['behind_ms'] for r in later):.1f} ms, "
              f"layout {statistics.median(r['layout_ms'] for r in later):.1f} ms")


if __name__ == "__main__":
    main()
