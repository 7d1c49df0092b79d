"""A GPU-rate token stream through the TUI: a fake engine handle emits K=8 replies' tokens a
step every millisecond, and nothing shown may be lost on the way (every token in the latency
log, every reply's full text in its Markdown widget), while the poll thread gathers the steps
into few messages (at most one per POST_S) instead of one per step. An engine on this machine's
CPU gets the UI's lighter pace (messages at most every CPU_POST_S, the prompt's cursor not
blinking, text drawn under CPU_DRAW_SHARE of the UI thread), with nothing lost either.

No assertion depends on how fast this machine is: a slower UI only gathers more per message.
"""

from __future__ import annotations

import threading
import time

import pytest
from textual.widgets import Input

from fgchat.engine.core import EngineConfig
from fgchat.protocol.events import EngineInfo, Mode, RequestFinished, RequestSummary, SamplingParams, TokenEvent
from fgchat.tui import engine_link
from fgchat.tui.app import FgchatApp
from fgchat.tui.messages import EngineEvents
from fgchat.tui.replies import CPU_DRAW_SHARE, DRAW_SHARE, MAX_TEXT_S, TEXT_S, text_gap
from test_tui import data_dir, wait_for  # noqa: F401
from test_tui_endpoint import EndpointHandle

pytestmark = pytest.mark.timeout(90)

K = 8
N = 160  # tokens per reply


def token_text(i: int) -> str:
    return f"w{i}" + (".\n\n" if i % 40 == 39 else " ")


class FastHandle(EndpointHandle):
    """EngineProcess's interface (the endpoint test's double, local this time); each prompt's
    replies decode together, one step a millisecond."""

    device = "cuda"
    step_s = 0.001

    def start(self) -> None:
        self.events.put(EngineInfo(
            model_name="fast", architecture="llama", device=self.device, dtype="bfloat16", max_context=4096,
            num_layers=2, attention_backend="triton", available_modes={}, mode=Mode.FULL))

    def submit_chats(self, messages, requests) -> None:
        threading.Thread(target=self._stream, args=([rid for rid, _ in requests],), daemon=True).start()

    def _stream(self, rids: list[int]) -> None:
        for i in range(N):
            time.sleep(self.step_s)
            now = time.monotonic_ns()
            for rid in rids:
                self.events.put(TokenEvent(
                    request_id=rid, token_index=i, token_id=100 + i, text=token_text(i), mode=Mode.FULL,
                    batch_size=len(rids), t_ns=now, itl_ms=None if i == 0 else 1.0, gpu_step_ms=0.9,
                    is_first_token=i == 0, position=5 + i, graph=f"full/b{len(rids)}",
                    launch_ms=None if i == 0 else 0.02))
        text = "".join(token_text(i) for i in range(N))
        for rid in rids:
            self.events.put(RequestFinished(RequestSummary(
                request_id=rid, prompt_tokens=5, output_tokens=N, ttft_ms=2.0, tpot_ms=1.0,
                e2e_ms=2.0 + N - 1, finish_reason="length", text=text)))


def streaming_app(handle: type[FastHandle]) -> tuple[FgchatApp, list[float]]:
    """The app on a `handle` engine, replies of N tokens, and the times of its engine messages."""
    app = FgchatApp(EngineConfig(model="fast"), engine_factory=lambda cfg: handle(),
                    sampling=SamplingParams(max_tokens=N, ignore_eos=True))
    return app, record_posts(app)


def record_posts(app: FgchatApp) -> list[float]:
    """The times at which the poll thread posts EngineEvents messages to `app`, as they happen."""
    posted_at: list[float] = []
    post = app.post_message

    def post_message(message) -> bool:  # called on the poll thread
        if isinstance(message, EngineEvents):
            posted_at.append(time.monotonic())
        return post(message)

    app.post_message = post_message
    return posted_at


async def test_every_token_of_a_fast_k8_stream_is_logged_and_shown_from_few_messages(data_dir):
    app, posted_at = streaming_app(FastHandle)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the engine's info", 10)
        app.set_samples(K)
        first_post = len(posted_at)
        assert await app.send_prompt("go")
        await wait_for(pilot, lambda: app.latency.log.request_count == K and not app.replies, "the replies", 60)

        tokens = app.latency.log.tokens_since(0)
        assert len(tokens) == K * N
        by_request: dict[int, list[int]] = {}
        for t in tokens:
            by_request.setdefault(t.request_id, []).append(t.token_index)
        assert len(by_request) == K
        assert all(indices == list(range(N)) for indices in by_request.values())

        expected = "".join(token_text(i) for i in range(N))
        bubbles = [b for b in app.chats.current.bubbles() if b.role == "assistant"]
        assert len(bubbles) == K
        for bubble in bubbles:
            assert bubble.text == expected
            assert bubble._body_md.source == expected  # all of it handed to the Markdown widget

        stream_posts = posted_at[first_post:]
        assert len(stream_posts) < N / 2, "the poll thread should gather steps into fewer messages"
        gaps = [b - a for a, b in zip(stream_posts, stream_posts[1:])]
        assert min(gaps) >= engine_link.POST_S * 0.9, "messages come at most every POST_S"
        assert app.link.posted == len(posted_at)
        assert app.query_one("#prompt", Input).cursor_blink  # a GPU engine leaves the UI as it is


class CpuHandle(FastHandle):
    """The same stream at a CPU engine's pace, from an engine on this machine's CPU."""

    device = "cpu"
    step_s = 0.01


async def test_an_engine_on_this_cpu_gets_fewer_messages_and_frames_and_loses_nothing(data_dir):
    app, posted_at = streaming_app(CpuHandle)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the engine's info", 10)
        assert not app.query_one("#prompt", Input).cursor_blink
        assert app.replies.draw_share == CPU_DRAW_SHARE
        first_post = len(posted_at)
        assert await app.send_prompt("go")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "the reply", 60)

        tokens = app.latency.log.tokens_since(0)
        assert [t.token_index for t in tokens] == list(range(N))
        (bubble,) = [b for b in app.chats.current.bubbles() if b.role == "assistant"]
        expected = "".join(token_text(i) for i in range(N))
        assert bubble.text == expected and bubble._body_md.source == expected

        stream_posts = posted_at[first_post:]
        gaps = [b - a for a, b in zip(stream_posts, stream_posts[1:])]
        # N steps of 10 ms: ~N / 10 messages at 10 Hz where a GPU engine's pace would post ~N / 2 (a
        # loaded machine stretches the steps, and the stream with them: the rate is what is bounded)
        assert len(stream_posts) <= N / 4
        assert min(gaps) >= engine_link.CPU_POST_S * 0.9, "messages come at most every CPU_POST_S"


def test_text_is_drawn_under_its_share_of_the_ui_thread_but_at_least_four_times_a_second():
    assert text_gap(0.001, DRAW_SHARE) == TEXT_S  # cheap draws: at most 20 Hz
    assert text_gap(0.04, DRAW_SHARE) == pytest.approx(0.08)  # 50% of the thread
    assert text_gap(0.003, CPU_DRAW_SHARE) == pytest.approx(0.1)  # beside a CPU engine: 3%
    assert text_gap(0.013, CPU_DRAW_SHARE) == MAX_TEXT_S == 0.25  # a long chat's dear draws: 4 Hz
