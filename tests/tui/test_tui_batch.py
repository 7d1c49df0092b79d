"""K replies as one batch, the sampling dialog and the footer hints (Pilot, real engine, tiny model, CPU).

The K replies of a prompt reach the engine as one command, so they are admitted and prefilled in
one round: every request's first token comes before any request's second, and each request's
first decode step (its token 1) runs at batch K. One-by-one submission (the engine picking up
request 1 and decoding it before request 2 arrives) fails both checks.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from textual.widgets import Button, Footer, Input, Label
from textual.widgets._footer import FooterKey, FooterLabel

from fgchat.engine.core import Engine
from fgchat.protocol.events import SamplingParams
from fgchat.tui.app import FgchatApp
from fgchat.tui.dialogs import SamplingScreen, parse_sampling
from fgchat.tui.sampling import K_TEMPERATURE, reply_params
from test_tui import assistant_bubbles, data_dir, key, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)

SIZE = (120, 40)


def first_round_checks(app: FgchatApp, rids: list[int], k: int) -> None:
    rows = [t for t in app.latency.log.tokens() if t.request_id in rids]
    firsts = [i for i, t in enumerate(rows) if t.token_index == 0]
    seconds = [i for i, t in enumerate(rows) if t.token_index == 1]
    assert len(firsts) == k and len(seconds) == k
    # one admission round: all K first tokens are logged before any request's second token
    assert max(firsts) < min(seconds), [(t.request_id, t.token_index, t.batch_size) for t in rows[:3 * k]]
    # and the first decode step of every request ran at batch K
    assert sorted(rows[i].batch_size for i in seconds) == [k] * k


def recording_engine(received: list[tuple[int, SamplingParams]]):
    """An engine factory whose engines note (request id, sampling) of every submission."""

    def make_engine(cfg):
        engine = Engine(cfg)
        submit = engine.submit

        def recording_submit(ids, params=None, request_id=None):
            received.append((request_id, params))
            return submit(ids, params, request_id=request_id)

        engine.submit = recording_submit
        return engine

    return make_engine


async def open_sampling_dialog(pilot, app: FgchatApp) -> SamplingScreen:
    await key(pilot, "f6")
    await wait_for(pilot, lambda: isinstance(app.screen, SamplingScreen)
                   and bool(app.screen.query("#sampling-seed")), "the sampling dialog")
    return app.screen


async def press_button(pilot, screen, selector: str) -> None:
    screen.query_one(selector, Button).press()
    await pilot.pause()


def test_reply_params_rule():
    greedy = SamplingParams(seed=5)
    assert reply_params(greedy, 1) == ([greedy], "")
    params, note = reply_params(greedy, 3)
    assert [p.temperature for p in params] == [K_TEMPERATURE] * 3
    assert [p.seed for p in params] == [5, 6, 7]
    assert note == "K=3: sampled at T 0.7 (greedy gives K copies)"
    warm = SamplingParams(temperature=1.2, top_p=0.9, top_k=7, seed=1)
    params, note = reply_params(warm, 2)
    assert note == "" and params == [warm, replace(warm, seed=2)]


def test_parse_sampling_refuses_bad_values():
    base = SamplingParams(max_tokens=9)
    ok = parse_sampling({"temperature": "0.8", "top_p": "0.95", "top_k": "40", "seed": "3"}, base)
    assert ok == replace(base, temperature=0.8, top_p=0.95, top_k=40, seed=3)
    for field, bad in [("temperature", "-1"), ("temperature", "nan"), ("top_p", "0"), ("top_p", "1.5"),
                       ("top_k", "2.5"), ("top_k", "-3"), ("seed", "x"), ("seed", str(2**63))]:
        values = {"temperature": "0.8", "top_p": "0.95", "top_k": "40", "seed": "3", field: bad}
        with pytest.raises(ValueError, match=field.replace("_", "-")):
            parse_sampling(values, base)


async def test_k8_replies_are_admitted_together_and_decode_at_batch_8(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=12)  # the engine in its own process, as in the app
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await key(pilot, "f5")  # K 1 -> 8 (wraps around)
        assert app.sampling.samples == 8
        assert any("K=8: sampled at T 0.7 (greedy gives K copies)" in text for _, text in app.notices)
        assert "K 8 · T 0.7 (K>1)" in app.sub_title
        conv = app.chats.current.conversation
        await type_prompt(pilot, "Eight replies at once")
        await wait_for(pilot, lambda: len(app.replies) == 8 or len(conv.messages) == 9, "eight replies")
        await wait_for(pilot, lambda: not app.replies, "eight replies finished", 60)
        rids = [m.meta["rid"] for m in conv.messages if m.role == "assistant"]
        assert len(rids) == 8
        first_round_checks(app, rids, 8)
        assert all(r.output_tokens == 12 for r in app.latency.log.requests())


async def test_k3_default_sampling_gives_three_texts_and_regenerate_batches(tiny_llama, data_dir):
    app = make_app(tiny_llama, max_tokens=24, thread=True)
    assert app.sampling.params.temperature == 0  # the default: greedy
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await key(pilot, "f4")
        await key(pilot, "f4")
        assert app.sampling.samples == 3
        conv = app.chats.current.conversation
        await type_prompt(pilot, "Tell me three different stories about a cat")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies, "three replies", 60)
        texts = [m.content for m in conv.messages if m.role == "assistant"]
        assert len(texts) == 3 and len(set(texts)) == 3, texts
        first = [m.meta["rid"] for m in conv.messages if m.role == "assistant"]
        first_round_checks(app, first, 3)

        # ctrl+r: the three are asked for again, as one batch, and the note says why they differ
        await key(pilot, "ctrl+r")
        await wait_for(pilot, lambda: any("regenerating: K=3: sampled at T 0.7" in text
                                          for _, text in app.notices), "the regenerate note")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies
                       and conv.messages[-1].meta.get("rid") not in first, "three new replies", 60)
        again = [m.meta["rid"] for m in conv.messages if m.role == "assistant"]
        assert len(again) == 3 and not set(again) & set(first)
        first_round_checks(app, again, 3)
        # same prompt, same seeds: the same three texts
        assert [m.content for m in conv.messages if m.role == "assistant"] == texts


async def test_sampling_dialog_sets_shows_sends_and_saves(tiny_llama, data_dir):
    received: list[tuple[int, SamplingParams]] = []
    app = make_app(tiny_llama, max_tokens=6, make_engine=recording_engine(received))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        # the palette offers the dialog instead of a fixed temperature
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Sampling: temperature, top-p, top-k, seed" in titles
        assert "Sampling: temperature 0.7" not in titles

        screen = await open_sampling_dialog(pilot, app)
        values = {"temperature": "1.3", "top-p": "1.5", "top-k": "5", "seed": "42"}
        for name, value in values.items():
            screen.query_one(f"#sampling-{name}", Input).value = value
        screen.query_one("#sampling-seed", Input).focus()
        await key(pilot, "enter")
        # invalid top-p: refused with a one-line error, the dialog stays open
        label = screen.query_one("#sampling-error", Label)
        await wait_for(pilot, lambda: str(label.visual).strip(), "the error line")
        assert app.screen is screen
        error = str(label.visual)
        assert "top-p" in error and "1.5" in error and "\n" not in error
        assert app.sampling.params.temperature == 0

        screen.query_one("#sampling-top-p", Input).value = "0.9"
        await key(pilot, "enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, SamplingScreen), "the dialog to close")
        want = replace(app.sampling.params, temperature=1.3, top_p=0.9, top_k=5, seed=42)
        assert app.sampling.params == want
        await pilot.pause(0.05)
        assert "K 1 · T 1.3 top-p 0.9 top-k 5 seed 42" in app.sub_title, app.sub_title
        saved = json.loads((data_dir / "settings.json").read_text())
        assert saved["sampling_overrides"] == {"temperature": 1.3, "top_p": 0.9, "top_k": 5, "seed": 42}

        # the next replies carry them: K = 2, seeds 42 and 43, the user's temperature kept
        await key(pilot, "f4")
        conv = app.chats.current.conversation
        await type_prompt(pilot, "hello")
        await wait_for(pilot, lambda: len(conv.messages) == 3 and not app.replies, "two replies")
        assert [p for _, p in received] == [want, replace(want, seed=43)]
        assert [r for r, _ in received] == sorted(m.meta["rid"] for m in conv.messages[1:])

        # Esc cancels without changing anything
        await open_sampling_dialog(pilot, app)
        app.screen.query_one("#sampling-temperature", Input).value = "2"
        await key(pilot, "escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, SamplingScreen), "cancelled")
        assert app.sampling.params == want

    # a restart keeps them (max_tokens stays the caller's)
    again = make_app(tiny_llama, max_tokens=7)
    assert again.sampling.params == replace(want, max_tokens=7)


async def test_largest_seed_with_k_replies_wraps_and_is_kept_after_a_restart(tiny_llama, data_dir):
    received: list[tuple[int, SamplingParams]] = []
    app = make_app(tiny_llama, max_tokens=4, make_engine=recording_engine(received))
    top = 2**63 - 1  # the largest seed the dialog accepts
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        screen = await open_sampling_dialog(pilot, app)
        screen.query_one("#sampling-seed", Input).value = str(top)
        screen.query_one("#sampling-seed", Input).focus()
        await key(pilot, "enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, SamplingScreen), "the dialog to close")
        await key(pilot, "f4")
        await key(pilot, "f4")
        conv = app.chats.current.conversation
        await type_prompt(pilot, "three replies")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies, "three replies")
        # reply j uses seed + j, wrapping around inside the seed range like the server's n
        assert [p.seed for _, p in received] == [top, 0, 1]
        assert [m.meta.get("error") for m in conv.messages[1:]] == [None] * 3
        assert all(m.meta["tokens"] == 4 for m in conv.messages[1:])

    # a restart keeps the saved seed, an int beyond float precision
    again = make_app(tiny_llama, max_tokens=4)
    assert again.sampling.problems == []
    assert again.sampling.params.seed == top


async def test_sampling_dialog_hint_wraps_inside_the_dialog(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        screen = await open_sampling_dialog(pilot, app)
        await pilot.pause(0.1)
        dialog = screen.query_one(".dialog")
        hint = screen.query_one(".dialog-hint", Label)
        text = str(hint.visual)
        assert "reply j uses seed + j" in text
        # every line of the hint is inside the dialog: it wraps rather than being cut at the edge
        assert hint.region.right <= dialog.content_region.right
        assert hint.size.height >= -(-len(text) // hint.size.width)


async def test_footer_shows_k_open_quit_and_fits_120_columns(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_ready(pilot, app)
        footer = app.query_one(Footer)
        wanted = {"f4", "f5", "f6", "ctrl+o", "ctrl+q", "escape", "f10", "ctrl+p"}
        keys: list[FooterKey] = []

        def laid_out() -> bool:  # the footer recomposes when bindings change: take one full snapshot
            keys[:] = list(footer.query(FooterKey))
            return wanted <= {k.key for k in keys} and all(k.region.width > 0 for k in keys)

        await wait_for(pilot, laid_out, "the footer keys laid out")
        # nothing overflows: every key ends before the palette key docked on the right
        palette = [k for k in keys if k.key == "ctrl+p"]
        limit = palette[0].region.x if palette else footer.region.right
        right = max(k.region.right for k in keys if k.key != "ctrl+p")
        assert right <= limit, [(k.key, k.region.x, k.region.right) for k in keys]
        assert footer.virtual_size.width <= footer.size.width
        # one blank cell after each group's label ("Mode", "Replies"), before the next key
        starts = sorted(k.region.x for k in keys)
        for label in footer.query(FooterLabel):
            after = [x for x in starts if x >= label.region.right]
            assert after and after[0] == label.region.right + 1, (str(label.render()), label.region, after[:1])


def test_submit_chats_tokenizes_once_and_reports_per_request_errors():
    from fgchat.protocol.events import EngineError
    from fgchat.engine.commands import SubmitChats
    from fgchat.engine.serve_loop import _apply

    class Tokenizer:
        calls = 0

        def apply_chat_template(self, messages, add_generation_prompt):
            Tokenizer.calls += 1
            return [1, 2, 3]

    class FakeEngine:
        tokenizer = Tokenizer()
        submitted: list[int] = []

        def submit(self, ids, params, request_id=None):
            params.validate()
            self.submitted.append(request_id)

    good, bad = SamplingParams(), SamplingParams(top_p=2.0)
    engine = FakeEngine()
    out = _apply(engine, SubmitChats([{"role": "user", "content": "hi"}], ((1, good), (2, bad), (3, good))))
    assert Tokenizer.calls == 1 and engine.submitted == [1, 3]
    assert len(out) == 1 and isinstance(out[0], EngineError) and out[0].request_id == 2
    assert "top-p" in out[0].message and not out[0].fatal

    engine.tokenizer = None
    out = _apply(engine, SubmitChats([{"role": "user", "content": "hi"}], ((4, good), (5, good))))
    assert [e.request_id for e in out] == [4, 5] and all("no tokenizer" in e.message for e in out)


async def test_sampling_starts_from_the_models_defaults_and_the_users_override_wins(tiny_llama, data_dir, tmp_path):
    """Issue 21: a model with a generation_config.json samples with its values (shown with their
    source); a field the user changes in F6 wins over it and is the only one saved."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}))
    sent: list[tuple[int, SamplingParams]] = []
    app = make_app(model, max_tokens=4, make_engine=recording_engine(sent))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        want = SamplingParams(temperature=0.6, top_p=0.8, top_k=20, repetition_penalty=1.1,
                              max_tokens=4, ignore_eos=True)
        assert app.sampling.params == want
        await pilot.pause(0.05)
        assert "T 0.6 top-p 0.8 top-k 20 seed 0 rep 1.1 · generation_config.json" in app.sub_title, app.sub_title
        conv = app.chats.current.conversation
        await type_prompt(pilot, "hello")
        await wait_for(pilot, lambda: len(conv.messages) == 2 and not app.replies, "a reply")
        assert [p for _, p in sent] == [want]

        # the dialog shows the defaults; the user changes temperature and presence penalty only
        screen = await open_sampling_dialog(pilot, app)
        assert screen.query_one("#sampling-repetition-penalty", Input).value == "1.1"
        screen.query_one("#sampling-temperature", Input).value = "0"
        screen.query_one("#sampling-presence-penalty", Input).value = "0.5"
        screen.query_one("#sampling-seed", Input).focus()
        await key(pilot, "enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, SamplingScreen), "the dialog to close")
        mine = replace(want, temperature=0.0, presence_penalty=0.5)
        assert app.sampling.params == mine
        saved = json.loads((data_dir / "settings.json").read_text())
        assert saved["sampling_overrides"] == {"temperature": 0.0, "presence_penalty": 0.5}
        await pilot.pause(0.05)
        assert "T 0 top-p 0.8 top-k 20 seed 0 rep 1.1 pres 0.5 · settings + generation_config.json" in app.sub_title
        await type_prompt(pilot, "again")
        await wait_for(pilot, lambda: len(conv.messages) == 4 and not app.replies, "a second reply")
        assert sent[-1][1] == mine

        # K = 2 with the user's greedy override: the K rule still samples at T 0.7
        await key(pilot, "f4")
        params, note = app.sampling.replies()
        assert [p.temperature for p in params] == [K_TEMPERATURE] * 2 and note

        # "Model defaults" in the dialog brings every field back and forgets the overrides
        screen = await open_sampling_dialog(pilot, app)
        # Button.press, not a click: a toast (the F4 notice) may lie over the button
        await press_button(pilot, screen, "#defaults")
        await wait_for(pilot, lambda: screen.query_one("#sampling-temperature", Input).value == "0.6", "defaults filled")
        await press_button(pilot, screen, "#save")
        await wait_for(pilot, lambda: not isinstance(app.screen, SamplingScreen), "the dialog to close")
        assert app.sampling.overrides == {} and app.sampling.params == want

    # the override is kept across runs and applies over the model's defaults once they arrive
    (data_dir / "settings.json").write_text(json.dumps({"sampling_overrides": {"top_k": 3}}))
    again = make_app(model, max_tokens=4)
    async with again.run_test(size=SIZE) as pilot:
        assert again.sampling.params.top_k == 3 and again.sampling.params.temperature == 0  # not loaded yet
        await wait_ready(pilot, again)
        assert again.sampling.params == replace(want, top_k=3)


def test_settings_from_before_model_defaults_become_overrides(tmp_path):
    from fgchat.tui.sampling import SamplingChoice
    from fgchat.tui.store import Settings

    (tmp_path / "settings.json").write_text(json.dumps(
        {"sampling": {"temperature": 0.0, "top_p": 0.9, "top_k": 0, "seed": 0}}))
    choice = SamplingChoice(Settings(tmp_path / "settings.json"), SamplingParams(max_tokens=9))
    assert choice.overrides == {"top_p": 0.9} and not choice.problems  # greedy built-ins were no choice
    choice.set_defaults(SamplingParams(temperature=0.7, top_p=0.95), "generation_config.json")
    assert choice.params == SamplingParams(temperature=0.7, top_p=0.9, max_tokens=9)
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["sampling_overrides"] == {"top_p": 0.9} and saved["sampling"] is None
    (tmp_path / "settings.json").write_text(json.dumps({"sampling_overrides": {"top_p": 7}}))
    bad = SamplingChoice(Settings(tmp_path / "settings.json"), SamplingParams())
    assert bad.overrides == {} and len(bad.problems) == 1 and "top-p" in bad.problems[0]
