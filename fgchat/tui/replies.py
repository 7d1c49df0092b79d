"""The replies in flight: the engine requests the chats are waiting for, from submission to their
stored end. `Replies` is a read-only mapping request id -> `Reply`.

Invariants:
- A reply is stored exactly once, when it finishes, stops, fails, its tab closes or the app
  exits, and leaves the mapping at that moment; storing happens before any UI update.
- Request ids are allocated here, unique for the app's lifetime (also across engine restarts),
  so log rows never mix two requests.
- Extra samples (K > 1) are stored with meta "alt" and never fed back as conversation turns.
- The K replies of one prompt go to the engine as one command (`EngineLink.submit`), after all K
  bubbles exist: the engine admits and prefills them in one round, so they decode at batch K
  from their first step.
- Streamed text is buffered in the bubbles and drawn in one pass for all replies (one layout of
  the screen for all of them, however fast the tokens come), at most every TEXT_S, and no more
  often than keeps drawing (the pass and its frame, `drawn`) under `draw_share` of the UI thread
  (DRAW_SHARE; CPU_DRAW_SHARE while the engine computes on this machine's CPU), but at least every
  MAX_TEXT_S;
  a reply's first text, and text after such a pause, is drawn at once. A reply that ends is
  drawn complete when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from fgchat.protocol.events import RequestSummary, TokenEvent
from fgchat.tui.chat_view import ChatView, MessageBubble, reply_status
from fgchat.tui.engine_link import EngineLink
from fgchat.tui.sampling import SamplingChoice
from fgchat.tui.store import Conversation, StoredMessage
from fgchat.tui.store_guard import StoreGuard

TEXT_S = 0.05  # streamed text is redrawn at most this often (20 Hz)
MAX_TEXT_S = 0.25  # ... and at least this often (4 Hz), whatever a redraw costs
DRAW_SHARE = 0.5  # ... and less often when a redraw costs more than this share of the UI thread
CPU_DRAW_SHARE = 0.03  # the share while the engine computes on this machine's CPU (it needs the cores)


def text_gap(cost_s: float, share: float) -> float:
    """Seconds between two draws of streamed text when one costs `cost_s` of the UI thread:
    drawing keeps under `share` of it, within [TEXT_S, MAX_TEXT_S] (a long chat makes every draw
    dearer; text still moves at least 4 times a second)."""
    return min(MAX_TEXT_S, max(TEXT_S, cost_s / share))


@dataclass
class Reply:
    """A reply being generated: one engine request."""

    rid: int
    conversation: Conversation
    bubble: MessageBubble
    sample: int  # 1-based index among the K replies asked for together
    of: int
    tokens: int = 0
    stopping: bool = False

    @property
    def primary(self) -> bool:
        return self.sample == 1


class Replies(Mapping[int, Reply]):
    """Replies in flight. `on_change(conversation)` runs when a conversation starts or stops
    waiting for replies (its tab label shows it)."""

    def __init__(self, link: EngineLink, sampling: SamplingChoice, guard: StoreGuard) -> None:
        self.link = link
        self.sampling = sampling
        self.guard = guard
        self.on_change: Callable[[Conversation], None] = lambda conversation: None
        self._active: dict[int, Reply] = {}
        self._next_rid = 1
        self._rid_chat: dict[int, str] = {}  # every request id ever sent -> its chat id
        self._unshown: set[int] = set()  # replies whose bubble holds text not drawn yet
        self._shown_at = 0.0  # time.monotonic() of the last `show`
        self._gap = TEXT_S  # seconds from one `show` to the next: TEXT_S or more (`drawn`)
        self.draw_share = DRAW_SHARE

    # ---- mapping -------------------------------------------------------------------------
    def __getitem__(self, rid: int) -> Reply:
        return self._active[rid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._active)

    def __len__(self) -> int:
        return len(self._active)

    def chat_of(self, rid: int) -> str:
        """The chat id of any request this app sent ("" for an unknown id)."""
        return self._rid_chat.get(rid, "")

    def busy(self, conversation: Conversation) -> bool:
        return any(r.conversation is conversation for r in self._active.values())

    def of(self, conversation: Conversation) -> list[Reply]:
        return [r for r in self._active.values() if r.conversation is conversation]

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, chat: ChatView) -> None:
        """Ask the engine for the chat's next K replies (K and sampling from `sampling`)."""
        conv = chat.conversation
        messages = conv.prompt_messages()
        params, _note = self.sampling.replies()
        k = len(params)
        requests = []
        # every bubble first, then one command: the engine gets the K requests at once
        for j in range(1, k + 1):
            rid = self._next_rid
            self._next_rid += 1
            label = f"assistant {j}/{k}" if k > 1 else "assistant"
            bubble = await chat.add_reply(label)
            self._active[rid] = Reply(rid, conv, bubble, j, k)
            self._rid_chat[rid] = conv.id
            requests.append((rid, params[j - 1]))
        self.link.submit(messages, requests, self.sampling.thinking)
        self.on_change(conv)

    def count(self, tokens: list[TokenEvent]) -> dict[int, list[tuple[str, bool]]]:
        """Count the tokens of the replies in flight; their new text per request id, as runs of
        (text, whether it came from accepted drafts)."""
        texts: dict[int, list[tuple[str, bool]]] = {}
        for ev in tokens:
            reply = self._active.get(ev.request_id)
            if reply is not None:
                reply.tokens += 1
                reply.bubble.think.feed(ev.text)
                if ev.text:
                    runs = texts.setdefault(ev.request_id, [])
                    if runs and runs[-1][1] == ev.drafted:
                        runs[-1] = (runs[-1][0] + ev.text, ev.drafted)
                    else:
                        runs.append((ev.text, ev.drafted))
        return texts

    def buffer(self, texts: dict[int, list[tuple[str, bool]]]) -> bool:
        """Add new text to the replies' bubbles without drawing it. True when it is due now:
        a reply's first text, or the gap since the last `show` passed; else `show_in()` says when."""
        first = False
        for rid, runs in texts.items():
            reply = self._active.get(rid)
            if reply is not None and runs:
                first = first or not reply.bubble.text
                for text, drafted in runs:
                    reply.bubble.buffer(text, drafted)
                self._unshown.add(rid)
        return bool(self._unshown) and (first or self.show_in() == 0.0)

    def show_in(self) -> float | None:
        """Seconds until buffered text is due (0.0: now); None when nothing waits."""
        if not self._unshown:
            return None
        return max(0.0, self._shown_at + self._gap - time.monotonic())

    def drawn(self, cost_s: float) -> None:
        """The last `show` and its frame took `cost_s` of the UI thread's CPU: space the next
        so that drawing stays under `draw_share` of it."""
        self._gap = text_gap(cost_s, self.draw_share)

    async def show(self) -> None:
        """Draw the buffered text of every reply (their chat views follow the end)."""
        self._shown_at = time.monotonic()
        unshown, self._unshown = self._unshown, set()
        for rid in unshown:
            reply = self._active.get(rid)
            if reply is not None:
                await reply.bubble.show_pending()

    async def finish(self, summary: RequestSummary) -> None:
        reply = self._active.pop(summary.request_id, None)
        self._unshown.discard(summary.request_id)
        if reply is None:
            return
        # store first (synchronously): nothing is lost if the UI update below is interrupted;
        # the timing goes with it, so a reopened chat shows the same stats line
        meta = {"finish": summary.finish_reason, "tokens": summary.output_tokens,
                "ttft_ms": round(summary.ttft_ms, 3),
                "tpot_ms": None if summary.tpot_ms is None else round(summary.tpot_ms, 3)}
        if summary.cached_tokens:
            meta["cached"] = summary.cached_tokens
        self._persist(reply, summary.text, meta)
        self.on_change(reply.conversation)
        await reply.bubble.finish(reply_status(meta), final_text=summary.text)

    async def fail(self, rid: int, message: str) -> None:
        reply = self._active.pop(rid, None)
        self._unshown.discard(rid)
        if reply is None:
            return
        self._persist(reply, reply.bubble.text, {"finish": "error", "error": message, "tokens": reply.tokens})
        self.on_change(reply.conversation)
        await reply.bubble.finish(f"error: {message} · partial reply kept ({reply.tokens} tok)")

    async def fail_all(self, message: str) -> None:
        for rid in list(self._active):
            await self.fail(rid, message)

    def stop(self, conversation: Conversation) -> None:
        """Esc: ask the engine to stop the conversation's replies (they end as "cancelled")."""
        for reply in self.of(conversation):
            if not reply.stopping:
                reply.stopping = True
                reply.bubble.set_status("stopping…")
                self.link.cancel(reply.rid)

    def drop(self, conversation: Conversation) -> None:
        """Its tab closes: cancel and store its replies now (finish "cancelled")."""
        for reply in self.of(conversation):
            self.link.cancel(reply.rid)
            self._persist(reply, reply.bubble.text, {"finish": "cancelled", "tokens": reply.tokens})
            del self._active[reply.rid]
            self._unshown.discard(reply.rid)

    def interrupt_all(self, log: Callable[[str], None]) -> None:
        """The app exits: store every reply in flight as it is (finish "interrupted")."""
        for reply in list(self._active.values()):
            try:
                self._persist(reply, reply.bubble.text, {"finish": "interrupted", "tokens": reply.tokens})
            except Exception as exc:
                log(f"could not save an interrupted reply: {exc!r}")
        self._active.clear()
        self._unshown.clear()

    def _persist(self, reply: Reply, text: str, meta: dict) -> None:
        meta = {**meta, "rid": reply.rid}
        if reply.bubble.think.found:
            meta["thinking_tokens"] = reply.bubble.think.tokens
        if reply.of > 1:
            meta.update(sample=reply.sample, of=reply.of)
        if not reply.primary:
            meta["alt"] = True  # extra samples are kept but not fed back as conversation turns
        msg = StoredMessage("assistant", text, meta)
        reply.conversation.messages.append(msg)
        reply.bubble.stored = msg  # type: ignore[attr-defined]
        self.guard.add_message(reply.conversation, msg)
