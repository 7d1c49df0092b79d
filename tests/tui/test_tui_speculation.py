"""Speculative decoding in the console: F9 cycles off → ngram → draft → off through the handle's
set_speculation (draft only with a draft model, else one notice says why), the title shows what
the engine confirmed ("full+ngram k4"), the panel the acceptance rate, tokens per step and the
per-step time beside the per-token ITL, and accepted drafted text is marked in the reply.

A scripted handle stands in for the engine (its speculation is issue 55's engine side): each
step proposes K drafts, accepts a scripted number of them and emits those tokens marked drafted
followed by the target's own token. The expected figures are computed from the script here."""

from __future__ import annotations

import threading
import time

import pytest

from fgchat.engine.core import EngineConfig
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import EngineInfo, Mode, RequestFinished, RequestSummary, SamplingParams, TokenEvent
from fgchat.tui.app import FgchatApp
from fgchat.tui.latency_panel import LatencyPanel
from fgchat.tui.speculation import NO_DRAFT
from test_tui import data_dir, key, wait_for  # noqa: F401
from test_tui_endpoint import EndpointHandle

pytestmark = pytest.mark.timeout(60)

K = 4
ACCEPTED = [3, 0, 4, 1, 2, 4, 0, 3]  # drafts accepted per step, in order
STEP_MS = 8.0  # the first token of a step waits for it; the drafts behind it come at once
SAME_STEP_MS = 0.05


class SpecHandle(EndpointHandle):
    """EngineProcess's interface (the endpoint test's double, local), with speculation:
    set_speculation and request_info answer with an EngineInfo naming the method."""

    def __init__(self, draft_model: str = "", refuse: bool = False) -> None:
        super().__init__()
        self.method = "off"
        self.draft_model = draft_model
        self.refuse = refuse
        self.asked: list[tuple[str, int | None]] = []

    def info(self) -> EngineInfo:
        return EngineInfo(model_name="spec", architecture="llama", device="cuda", dtype="bfloat16",
                          max_context=4096, num_layers=2, attention_backend="triton", available_modes={},
                          mode=Mode.FULL, speculate=self.method, draft_len=K if self.method != "off" else 0,
                          draft_model=self.draft_model)

    def start(self) -> None:
        self.events.put(self.info())

    def set_speculation(self, method: str, draft_len: int | None = None) -> None:
        if self.refuse:
            raise FgchatError("speculation runs in the local engine, not through an endpoint")
        self.asked.append((method, draft_len))
        self.method = method

    def request_info(self) -> None:
        self.events.put(self.info())

    def submit_chats(self, messages, requests) -> None:
        threading.Thread(target=self._stream, args=(requests[0][0],), daemon=True).start()

    def _stream(self, rid: int) -> None:
        t = time.monotonic_ns()
        pieces = [("first ", False, -1, 0)]  # (text, drafted, step, accepted in step)
        for step, a in enumerate(ACCEPTED):
            pieces += [(f"d{step}.{j} ", True, step, a) for j in range(a)] + [(f"t{step} ", False, step, a)]
        for i, (text, drafted, step, a) in enumerate(pieces):
            first_of_step = i == 0 or pieces[i - 1][2] != step
            itl = None if i == 0 else (STEP_MS if first_of_step else SAME_STEP_MS)
            t += int((itl or 1.0) * 1e6)
            self.events.put(TokenEvent(
                rid, i, 100 + i, text, Mode.FULL, 1, t, itl, None, i == 0, 5 + i,
                step_id=step, drafted=drafted, draft_len=K if step >= 0 else 0, accepted_in_step=a,
                spec_method=self.method if step >= 0 else ""))
        self.events.put(RequestFinished(RequestSummary(
            rid, 5, len(pieces), 2.0, STEP_MS, 100.0, "length", "".join(p[0] for p in pieces))))



def spec_app(handle: SpecHandle) -> FgchatApp:
    return FgchatApp(EngineConfig(model="spec"), engine_factory=lambda cfg: handle,
                     sampling=SamplingParams(max_tokens=64, ignore_eos=True))


async def test_f9_cycles_speculation_and_the_title_shows_it(data_dir):  # noqa: F811
    handle = SpecHandle()
    app = spec_app(handle)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the engine's info", 10)
        assert " · full · " in app.sub_title
        await key(pilot, "f9")
        assert handle.asked == [("ngram", None)]
        await wait_for(pilot, lambda: "full+ngram k4 · " in app.sub_title, "the title to show ngram")
        # no draft model: the cycle goes back to off, and says why once
        await key(pilot, "f9")
        assert handle.asked[-1] == ("off", None)
        assert any(NO_DRAFT in text for _, text in app.notices)
        await wait_for(pilot, lambda: " · full · " in app.sub_title, "the title without speculation")


async def test_draft_is_offered_with_a_draft_model(data_dir):  # noqa: F811
    handle = SpecHandle(draft_model="Llama-3.2-1B-Instruct")
    app = spec_app(handle)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the engine's info", 10)
        for _ in range(3):
            await key(pilot, "f9")
        assert [m for m, _ in handle.asked] == ["ngram", "draft", "off"]
        assert not any(NO_DRAFT in text for _, text in app.notices)


async def test_an_endpoint_refusal_is_one_notice(data_dir):  # noqa: F811
    app = spec_app(SpecHandle(refuse=True))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the engine's info", 10)
        await key(pilot, "f9")
        refusal = ("warning", "speculation runs in the local engine, not through an endpoint")
        await wait_for(pilot, lambda: refusal in app.notices, "the refusal's notice", 10)
        assert app.notices.count(refusal) == 1
        assert "+ngram" not in app.sub_title


async def test_panel_shows_acceptance_and_the_reply_marks_drafted_text(data_dir):  # noqa: F811
    handle = SpecHandle()
    app = spec_app(handle)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.link.state == "ready", "the engine's info", 10)
        panel = app.query_one(LatencyPanel)
        assert not panel.query_one("#spec-line").display  # off, nothing seen: hidden
        await key(pilot, "f9")
        await wait_for(pilot, lambda: app.link.info.speculate == "ngram", "ngram confirmed")
        assert await app.send_prompt("go")
        await wait_for(pilot, lambda: app.latency.log.request_count == 1 and not app.replies, "the reply")
        rate = sum(ACCEPTED) / (K * len(ACCEPTED))
        per_step = (sum(ACCEPTED) + len(ACCEPTED)) / len(ACCEPTED)
        step_ms = STEP_MS + SAME_STEP_MS * sum(ACCEPTED) / len(ACCEPTED)
        await wait_for(pilot, lambda: "accept" in panel.text_of("spec-line"), "the spec line")
        lines = panel.text_of("spec-line").split("\n")
        print("\n".join(lines))
        assert lines[0] == (f"spec ngram k{K}  accept {rate * 100:.0f}%  tok/step {per_step:.2f}  "
                            f"step {step_ms:.2f} ms")
        assert lines[1].startswith("ITL/tok ") and lines[1].endswith(f"n={sum(ACCEPTED) + len(ACCEPTED)}")
        assert lines[2].startswith("step    ") and lines[2].endswith(f"n={len(ACCEPTED)}")
        # the two humps: token ITLs pile up at both ends of the axis, steps only at the slow end
        itl_bars, step_bars = lines[1][8:].split(" n=")[0], lines[2][8:].split(" n=")[0]
        assert itl_bars[0] != " " and itl_bars[-1] != " " and step_bars[0] == " " and step_bars[-1] != " "

        (bubble,) = [b for b in app.chats.current.bubbles() if b.role == "assistant"]
        drafted = [bubble.text[a:b] for a, b in bubble.drafted]
        expected = ["".join(f"d{s}.{j} " for j in range(a)) for s, a in enumerate(ACCEPTED) if a]
        assert drafted == expected
        marked = bubble.query_one(".bubble-marked")
        content = marked.visual
        assert content.plain == bubble.text
        styled = [content.plain[s.start:s.end] for s in content.spans if str(s.style) == "$spec-drafted"]
        assert styled == expected
        assert not bubble._body_md.display


def test_title_label_marks_a_switch_not_confirmed():
    from fgchat.tui.speculation import SpecToggle

    toggle = SpecToggle()
    info = SpecHandle().info()
    assert toggle.label("full", info, None) == "full"
    toggle.requested = "ngram"
    assert toggle.label("full", info, None) == "full+off→ngram?"
    handle = SpecHandle()
    handle.method = "ngram"
    toggle.confirmed(handle.info())
    assert toggle.requested is None and toggle.label("full", handle.info(), None) == "full+ngram k4"
