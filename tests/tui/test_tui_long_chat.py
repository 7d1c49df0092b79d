"""A long chat streams at the cost of a short one: each draw of streamed text lays the screen out,
at a cost that grows with the widgets laid out, so finished bubbles that scrolled off above the
view leave the layout when a round starts (shelved behind one spacer of their height), and come
back unchanged when the user scrolls up to them. Pilot with a real engine on the tiny model (CPU),
helpers from test_tui."""

from __future__ import annotations

import pytest

from textual.widgets import Markdown

from fgchat.tui.chat_view import sanitize
from test_tui import data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(240)

TURNS = 8


def laid_out(view, widgets) -> list:
    """Those of `widgets` in the screen's current layout."""
    placed = view.screen._compositor.widgets
    return [w for w in widgets if w in placed]


async def test_bubbles_scrolled_off_leave_the_layout_while_a_long_chat_streams(tiny_llama, data_dir):
    app = make_app(tiny_llama, thread=True, max_tokens=40, max_context=4096)
    async with app.run_test(size=(100, 24)) as pilot:
        await wait_ready(pilot, app)
        view = app.chats.current
        for turn in range(TURNS):
            await type_prompt(pilot, f"question {turn}")
            await wait_for(pilot, lambda: not app.replies and len(view.conversation.messages) == 2 * (turn + 1),
                           f"reply {turn}", 60)
            await pilot.pause(0.1)
        assert view.virtual_size.height > 3 * view.scrollable_content_region.height, "the chat outgrew its view"

        # a new round streams: of the finished bubbles, only those reaching into the last screen
        # (the first of them may straddle its top) are laid out
        await type_prompt(pilot, "one more")
        await wait_for(pilot, lambda: len(view.bubbles()) == 2 * TURNS + 2, "the new round's bubbles", 10)
        await pilot.pause(0.1)
        bubbles = view.bubbles()
        finished = laid_out(view, bubbles[:2 * TURNS])
        assert finished, "the last finished bubble stays in the layout"
        heights = [b.outer_size.height + b.styles.margin.bottom for b in finished[1:]]
        assert sum(heights) <= view.scrollable_content_region.height, (len(finished), heights)
        every_widget = list(view.walk_children(with_self=False))
        assert len(laid_out(view, every_widget)) < len(every_widget) / 2

        await wait_for(pilot, lambda: not app.replies, "the last reply", 60)
        # select all (a triple click) while bubbles are shelved: every message, in order, and
        # nothing of the spacer that stands in for the shelved ones
        assert view._shelf.display
        view.text_select_all()
        text = app.screen.get_selected_text()
        at = [text.index(f"question {t}") for t in range(TURNS)]
        assert at == sorted(at) and "one more" in text[at[-1]:]
        assert "Widget" not in text and "shelf" not in text, text[:200]
        app.screen.clear_selection()
        # regenerated while bubbles are shelved: the replaced reply goes, the shelf stays true
        await app.action_chat("regenerate")
        await wait_for(pilot, lambda: not app.replies and len(view.conversation.messages) == 2 * TURNS + 2,
                       "the regenerated reply", 60)
        await pilot.pause(0.2)
        height = view.virtual_size.height

        # scrolled to the top, every bubble is back, where it was, with all its text
        view.scroll_home(animate=False, immediate=True)
        await pilot.pause(0.2)
        bubbles = view.bubbles()
        assert laid_out(view, bubbles) == bubbles
        assert view.virtual_size.height == height
        assert [(b.role, b.text) for b in bubbles] == [(m.role, m.content) for m in view.conversation.messages]
        assert bubbles[0].region.intersection(view.content_region).height > 0
        bodies = [b.query_one(Markdown) for b in bubbles if b.role == "assistant"]
        assert all(body.source == sanitize(body.parent.text) and body.region.height for body in bodies)
