"""One conversation on screen: system prompt line, user turns, streaming Markdown replies.

Invariants:
- A bubble's `text` is everything received for it; `buffer` adds to it without drawing,
  `show_pending` appends what the Markdown widget has not got yet, so the caller decides how
  often a streamed reply is redrawn (each redraw lays the screen out again).
- A reply's think block (thinking.py) is drawn folded: one summary line (its token count, live
  while it streams) above the answer, the thinking's own Markdown only once it is expanded. A
  reply without one has the header and the answer's Markdown only, as before; its stored and
  copied text is always the whole reply as the engine produced it.
- Drafted text (tokens a speculative step proposed and the target accepted) is kept as spans of
  `text`; a reply with any is shown as plain text with those spans in the theme's
  $spec-drafted colour (a Static mounted in place of its Markdown at its first drafted token).
- Every bubble's Markdown uses one shared parser (Textual's default builds a new one for every
  append, which costs more than parsing a streamed fragment).
- Finished bubbles wholly above the view when a round of replies starts are shelved: hidden
  (`display` off, out of every layout) behind one spacer exactly as tall as they were, so the
  content's height and every position in it stay the same. Each draw of streamed text lays out
  the screen, at a cost that grows with the widgets laid out; shelving keeps that to what the
  last screens hold however long the chat is. Scrolling up into the spacer, a change of width,
  or removing bubbles puts them all back first.
"""

from __future__ import annotations

import asyncio

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.geometry import Size
from textual.selection import Selection
from textual.widget import Widget
from textual.widgets import Markdown, Static

from fgchat.tui.bindings import THINK_KEY_LABEL
from fgchat.tui.store import Conversation, StoredMessage
from fgchat.tui.thinking import ThinkCounter, ThinkSplit, split_thinking, thinking_summary

# C0 controls (except tab and newline) and DEL would move the terminal cursor: show them as U+FFFD
_CONTROL = {c: "\ufffd" for c in (*range(0, 9), *range(11, 32), 127)}


def sanitize(text: str) -> str:
    return text.translate(_CONTROL)


_PARSER = MarkdownIt("gfm-like")  # Textual's default parser; parse() keeps no state between calls


def _shared_parser() -> MarkdownIt:
    return _PARSER


class _ThinkingSummary(Static):
    """The folded think block's line; a click expands or folds it."""

    async def on_click(self) -> None:
        bubble = self.parent
        if isinstance(bubble, MessageBubble):
            await bubble.toggle_thinking()


class MessageBubble(Vertical):
    """A user turn (plain text) or an assistant reply (Markdown, streamed while it is generated)."""

    def __init__(self, role: str, text: str = "", *, label: str = "", streaming: bool = False) -> None:
        super().__init__(classes=f"bubble {role}")
        self.role = role
        self.heading = label or ("you" if role == "user" else "assistant")
        self.text = text  # everything received so far (raw, as the engine produced it)
        self.streaming = streaming
        self.status = "generating…" if streaming else ""
        self._writing = asyncio.Lock()  # one Markdown append (or update) at a time, in order
        self._body_md: Markdown | None = None
        self._shown = 0  # characters of the answer (all the text but a think block) handed to the Markdown
        self.appends = 0  # streamed fragments received (each engine batch with text adds one)
        self.think = ThinkCounter()  # the streamed reply's thinking tokens (Replies feeds it)
        self.thinking_tokens: int | None = None  # a stored reply's (its meta), when known
        self.expanded = False  # the think block is shown whole, not folded
        self._summary: _ThinkingSummary | None = None
        self._think_md: Markdown | None = None
        self._think_shown = 0  # characters of the thinking handed to self._think_md
        self.drafted: list[tuple[int, int]] = []  # [start, end) spans of `text` that were accepted drafts
        self._marked: Static | None = None  # shows text with the drafted spans marked

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="bubble-header")
        if self.role == "user":
            yield Static(Content(sanitize(self.text)), classes="bubble-body")
        else:
            split = self._split()
            if split.thinking is not None:
                self._summary = _ThinkingSummary(self._summary_text(), classes="thinking-summary")
                yield self._summary
            self._body_md = Markdown(sanitize(split.answer), classes="bubble-body", parser_factory=_shared_parser)
            self._shown = len(split.answer)
            yield self._body_md

    def on_mount(self) -> None:
        self.call_after_refresh(self.show_pending)  # text that arrived while mounting

    def _header(self) -> Content:
        style = "bold $primary" if self.role == "user" else "bold $accent"
        status_style = "$error" if self.status.startswith(("error", "⚠")) else "$text-muted"
        return Content.assemble((self.heading, style), ("  " if self.status else "", ""), (self.status, status_style))

    def set_status(self, status: str) -> None:
        """Record `status` and redraw the header where one is shown. A bubble whose children are
        being removed (the app exiting while a reply ends) has none: nothing to draw then."""
        self.status = status
        for header in self.query(".bubble-header").results(Static):
            header.update(self._header())

    def buffer(self, text: str, drafted: bool = False) -> None:
        """Add streamed text without drawing it (`show_pending` does); `drafted`: it came from
        accepted drafts of a speculative step."""
        if text:
            start = len(self.text)
            self.text += text
            self.appends += 1
            if drafted:
                if self.drafted and self.drafted[-1][1] == start:
                    self.drafted[-1] = (self.drafted[-1][0], len(self.text))
                else:
                    self.drafted.append((start, len(self.text)))

    def marked_content(self) -> Content:
        """The text with its drafted spans in $spec-drafted."""
        parts: list[tuple[str, str] | str] = []
        at = 0
        for start, end in self.drafted:
            start, end = min(start, len(self.text)), min(end, len(self.text))
            if start > at:
                parts.append(sanitize(self.text[at:start]))
            if end > start:
                parts.append((sanitize(self.text[start:end]), "$spec-drafted"))
            at = max(at, end)
        if at < len(self.text):
            parts.append(sanitize(self.text[at:]))
        return Content.assemble(*parts)

    async def show_pending(self) -> None:
        """Append the text not shown yet to the Markdown widget and wait for it to be laid out
        (the caller paces this; a batch of them shares one frame). Appends of one bubble run
        one at a time, in order. Text that arrives before the Markdown widget is mounted is
        kept and written once it is."""
        async with self._writing:
            markdown = self._body_md
            if markdown is not None and markdown.is_mounted and self.drafted:
                await self._show_marked(markdown)
                return
            if markdown is None or not markdown.is_mounted:
                return
            split = self._split()
            if split.thinking is not None:
                await self._draw_thinking(split)
            if self._shown >= len(split.answer):
                return
            fragment = split.answer[self._shown:]
            self._shown = len(split.answer)
            await markdown.append(sanitize(fragment))

    # ---- the think block -----------------------------------------------------------------
    def _split(self) -> ThinkSplit:
        return split_thinking(self.text, final=not self.streaming)

    @property
    def has_thinking(self) -> bool:
        return self.role == "assistant" and self._split().thinking is not None

    def _summary_text(self) -> Content:
        tokens = self.think.tokens if self.think.found else self.thinking_tokens
        line = thinking_summary(tokens, streaming=self.streaming and self.think.state != "closed",
                                expanded=self.expanded, key=THINK_KEY_LABEL)
        return Content.styled(line, "italic $text-muted")

    async def _draw_thinking(self, split: ThinkSplit) -> None:
        """The summary line (mounted above the answer when the block appears) and, expanded,
        the thinking not drawn yet. Runs under `_writing`."""
        if self._summary is None:
            self._summary = _ThinkingSummary(self._summary_text(), classes="thinking-summary")
            await self.mount(self._summary, before=self._body_md)
        else:
            self._summary.update(self._summary_text())
        thinking = split.thinking or ""
        if self.expanded and self._think_md is not None and self._think_shown < len(thinking):
            fragment = thinking[self._think_shown:]
            self._think_shown = len(thinking)
            await self._think_md.append(sanitize(fragment))

    async def toggle_thinking(self) -> bool:
        """Expand or fold the think block; False when the reply has none."""
        split = self._split()
        if self.role != "assistant" or split.thinking is None:
            return False
        async with self._writing:
            self.expanded = not self.expanded
            if self.expanded:
                if self._think_md is None:
                    self._think_md = Markdown("", classes="thinking-body", parser_factory=_shared_parser)
                    await self.mount(self._think_md, before=self._body_md)
                self._think_md.display = True
                await self._think_md.update(sanitize(split.thinking))
                self._think_shown = len(split.thinking)
            elif self._think_md is not None:
                self._think_md.display = False
            if self._summary is not None:
                self._summary.update(self._summary_text())
        return True
    async def _show_marked(self, markdown: Markdown) -> None:
        if self._marked is None:
            self._marked = Static(classes="bubble-body bubble-marked")
            await self.mount(self._marked, after=markdown)
            markdown.display = False
        self._shown = len(self.text)
        self._marked.update(self.marked_content())

    async def finish(self, status: str, final_text: str | None = None) -> None:
        """Stop streaming; make sure the shown text equals `final_text` (the engine's summary)."""
        self.streaming = False
        self.set_status(status)  # before any await: the bubble's state is final at once
        if final_text is not None and final_text != self.text:
            if final_text.startswith(self.text):
                self.buffer(final_text[len(self.text):])
            else:
                self.text = final_text
                self.drafted = [(a, b) for a, b in self.drafted if b <= len(final_text)]
                split = self._split()
                async with self._writing:
                    if self._body_md is not None and self._body_md.is_mounted:
                        await self._body_md.update(sanitize(split.answer))
                        self._shown = len(split.answer)
                    if self._think_md is not None and split.thinking is not None:
                        await self._think_md.update(sanitize(split.thinking))
                        self._think_shown = len(split.thinking)
        await self.show_pending()


class _Shelf(Widget):
    """The spacer standing in for shelved bubbles: blank, and no text of its own in a selection
    (the shelved bubbles' text is selected from them)."""

    ALLOW_SELECT = False

    def render(self) -> Content:
        return Content("")

    def get_selection(self, selection: Selection) -> None:
        return None


class ChatView(VerticalScroll):
    """The scrollback of one conversation. The app owns the Conversation and the engine traffic."""

    def __init__(self, conversation: Conversation, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="chat-view")
        self.conversation = conversation
        self._shelf = _Shelf(classes="shelf")  # stands in for the shelved bubbles, as tall as they were
        self._shelf.display = False
        self._shelf_bottom = 0  # virtual y just below the shelf while it is shown
        self._shelved_width = 0  # the view's width when bubbles were shelved

    def compose(self) -> ComposeResult:
        yield Static(self._system_line(), classes="system-line")
        yield self._shelf
        for msg in self.conversation.messages:
            yield self._bubble_for(msg)

    def on_mount(self) -> None:
        self.call_after_refresh(self.follow)

    def on_resize(self) -> None:
        """The view changed size (terminal, panel toggled): keep following the end. A new width
        re-wraps the shelved bubbles, so the shelf's height no longer holds: they come back."""
        if self._shelf.display and self.size.width != self._shelved_width:
            self.unshelve()
        self.follow()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        """Scrolled up into the shelf: the shelved bubbles come back (at the same positions)."""
        super().watch_scroll_y(old_value, new_value)
        if self._shelf.display and new_value < self._shelf_bottom:
            self.unshelve()

    def shelve(self) -> None:
        """Shelve the finished bubbles that lie wholly above the view, from the last layout.
        A bubble is shelved only with every bubble before it, and only when the next bubble has
        been laid out and starts at or above the view's top (so its own margin is above it too)."""
        if not self.is_on_screen or self.size.height == 0:
            return
        top = int(self.scroll_y)
        shown = [b for b in self.query_children(MessageBubble) if b.display]
        regions = [b.virtual_region for b in shown]
        shelved = 0
        while (shelved + 1 < len(shown) and not shown[shelved].streaming
               and regions[shelved].height and regions[shelved + 1].height
               and regions[shelved + 1].y <= top):
            shelved += 1
        if not shelved:
            return
        start = self._shelf.virtual_region.y if self._shelf.display else regions[0].y
        self._shelf_bottom = regions[shelved].y
        self._shelved_width = self.size.width
        self._shelf.styles.height = self._shelf_bottom - start
        self._shelf.display = True
        for bubble in shown[:shelved]:
            bubble.display = False

    def unshelve(self) -> None:
        """Every shelved bubble back in the layout; the shelf hidden."""
        if not self._shelf.display:
            return
        for bubble in self.query_children(MessageBubble):
            bubble.display = True
        self._shelf.display = False
        self._shelf_bottom = 0

    def watch_virtual_size(self, old: Size, new: Size) -> None:
        """The content changed size (streamed text, Markdown blocks mounted after their parse,
        a re-wrap): keep following the end once this layout is done. Content growing under an
        anchored view needs nothing (Textual keeps the end in view, and `follow` would change
        nothing); skipping it saves asking the compositor for regions on every streamed redraw."""
        if self.is_anchored and new.height >= old.height:
            return
        self.call_after_refresh(self.follow)

    def on_show(self) -> None:
        """A tab switched to: its last message at the bottom of the view (or the chat from the
        top when it fits), also when the user had scrolled up before leaving it."""
        self.follow(reengage=True)
        self.call_after_refresh(self.follow)  # once the shown pane has been laid out

    def follow(self, reengage: bool = False) -> None:
        """Invariant: a shown view whose content overflows it is anchored (Textual then keeps
        the end in view as content grows, until the user scrolls up); one whose content fits is
        not anchored and shows the chat from the top. Anchoring only once the content
        overflows keeps a short chat at the top instead of at the bottom of the view.

        A hidden view (another tab) has no height: it is settled when it is shown instead."""
        if not self.is_on_screen or self.size.height == 0:
            return
        if self.virtual_size.height > self.scrollable_content_region.height:
            if reengage or not self.is_anchored:
                self.anchor()  # scrolls to the end at once
        elif self.is_anchored or self.scroll_y:
            self.anchor(False)
            self.scroll_to(y=0, animate=False, immediate=True, force=True)

    def _system_line(self) -> Content:
        prompt = " ".join(self.conversation.system_prompt.split()) or "(none)"
        return Content.assemble(("system ", "bold $text-muted"), (prompt, "italic $text-muted"),
                                ("  ctrl+t edits", "$text-muted"))

    def refresh_system_line(self) -> None:
        self.query_one(".system-line", Static).update(self._system_line())

    @staticmethod
    def _bubble_for(msg: StoredMessage) -> MessageBubble:
        label = ""
        if msg.role == "assistant" and msg.meta.get("of", 1) > 1:
            label = f"assistant {msg.meta.get('sample', 1)}/{msg.meta['of']}"
        bubble = MessageBubble(msg.role, msg.content, label=label)
        bubble.status = reply_status(msg.meta) if msg.role == "assistant" else ""
        tokens = msg.meta.get("thinking_tokens")
        bubble.thinking_tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
        bubble.stored = msg  # type: ignore[attr-defined]
        return bubble

    async def add_message(self, msg: StoredMessage) -> MessageBubble:
        bubble = self._bubble_for(msg)
        await self.mount(bubble)
        return bubble

    async def add_reply(self, label: str) -> MessageBubble:
        """A streaming reply's bubble at the end; what scrolled off above is shelved first."""
        self.shelve()
        bubble = MessageBubble("assistant", label=label, streaming=True)
        await self.mount(bubble)
        return bubble

    async def remove_bubbles(self, bubbles: list[MessageBubble]) -> None:
        """Remove `bubbles` (the shelf's height counts shelved ones: everything comes back first)."""
        self.unshelve()
        for bubble in bubbles:
            await bubble.remove()

    def bubbles(self) -> list[MessageBubble]:
        return list(self.query(MessageBubble))


def reply_stats(meta: dict) -> str:
    """The per-reply stats line of a finished reply, from its stored meta:
    "24 tok · TTFT 12 ms (448 cached) · 85.3 tok/s" (the parts that are known; "cached": prompt
    tokens whose K/V the engine still held, so the prefill skipped them)."""
    parts: list[str] = []
    tokens = meta.get("tokens")
    if isinstance(tokens, int):
        parts.append(f"{tokens} tok")
    ttft = meta.get("ttft_ms")
    if isinstance(ttft, (int, float)):
        cached = meta.get("cached")
        parts.append(f"TTFT {ttft:.0f} ms" + (f" ({cached} cached)" if isinstance(cached, int) and cached else ""))
    tpot = meta.get("tpot_ms")
    if isinstance(tpot, (int, float)) and tpot > 0:
        parts.append(f"{1000.0 / tpot:.1f} tok/s")
    return " · ".join(parts)


def reply_status(meta: dict) -> str:
    """A finished reply's header status (live and reopened alike): stats, then how it ended.
    Errors show the error (with the partial reply's token count)."""
    if meta.get("error"):
        note = f"error: {meta['error']}"
        if isinstance(meta.get("tokens"), int):
            note += f" · partial reply kept ({meta['tokens']} tok)"
        return note
    return " · ".join(x for x in (reply_stats(meta), _finish_note(meta)) if x)


def _finish_note(meta: dict) -> str:
    finish = meta.get("finish")
    if meta.get("error"):
        return f"error: {meta['error']}"
    return {
        "cancelled": "stopped",
        "length": "length limit",
        "interrupted": "interrupted (app closed)",
        "error": "error",
    }.get(finish or "", "")
