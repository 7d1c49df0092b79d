"""What a finished round of replies leaves alive (its bubbles, their Markdown blocks, the latency
log's records) is frozen out of the cyclic collector's full walks once no reply is in flight: a
full collection walks every object not frozen, and a chat and its log only grow, so the UI
thread's time per token would grow with the session. Cyclic garbage among objects frozen in an
earlier round is still collected (the heap is unfrozen for that walk). Pilot with a real engine on the tiny model
(CPU), helpers from test_tui."""

from __future__ import annotations

import gc
import weakref

import pytest

from test_tui import data_dir, make_app, type_prompt, wait_for, wait_ready  # noqa: F401

pytestmark = pytest.mark.timeout(120)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_what_a_finished_round_leaves_is_out_of_the_full_collections(tiny_llama, data_dir):
    gc.unfreeze()
    app = make_app(tiny_llama, thread=True, max_tokens=12)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_ready(pilot, app)
            view = app.chats.current
            cycle = _Cycle()
            gone = weakref.ref(cycle)
            for turn in range(2):
                await type_prompt(pilot, f"question {turn}")
                await wait_for(pilot, lambda: not app.replies and len(view.conversation.messages) == 2 * (turn + 1),
                               f"reply {turn}", 60)
                await pilot.pause(0.2)
                tracked = {id(o) for o in gc.get_objects()}  # the frozen generation is not listed
                widgets = [w for b in view.bubbles() for w in b.walk_children(with_self=True)]
                assert len(widgets) >= 4 * (turn + 1)
                walked = [w for w in widgets if id(w) in tracked]
                assert not walked, f"turn {turn}: {len(walked)} of {len(widgets)} widgets still walked"
                records = app.latency.log.tokens() + app.latency.log.requests()
                assert len(records) == (turn + 1) * 13
                assert not [r for r in records if id(r) in tracked]
                if turn == 0:
                    assert id(cycle) not in tracked, "the cycle was frozen with the round"
                    cycle = None  # cyclic garbage among frozen objects, as a removed bubble is
                else:
                    assert gone() is None, "cyclic garbage frozen in an earlier round is never collected"
            # nothing the user produced went with the freeze
            replies = [m for m in view.conversation.messages if m.role == "assistant"]
            assert [b.text for b in view.bubbles()[1::2]] == [m.content for m in replies]
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
