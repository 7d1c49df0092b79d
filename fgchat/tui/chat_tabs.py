"""The chat tabs: one `ChatView` per open conversation, and every chat action (send, new, close,
next/previous, open a saved one, system prompt, copy reply, regenerate, stop).

Invariants:
- At least one chat tab is always open.
- Closing a tab cancels and stores its in-flight replies (finish="cancelled"); the conversation
  stays saved.
- A user turn is stored when it is sent, before its bubble is shown; a failed store keeps it in
  memory (one-line notification).
- A chat has at most one round of replies in flight: sending or regenerating waits for it.
"""

from __future__ import annotations

from textual.widgets import ContentSwitcher, TabbedContent, TabPane

from fgchat.tui.chat_view import ChatView
from fgchat.tui.dialogs import OpenChatScreen, SystemPromptScreen
from fgchat.tui.replies import Replies
from fgchat.tui.store import DEFAULT_SYSTEM_PROMPT, Conversation, StoredMessage, new_chat_id, title_from


class ChatTabs(TabbedContent):
    """The tabs and their actions; `replies` submits to the engine and stores what comes back."""

    def __init__(self, replies: Replies, settings, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.replies = replies
        self.guard = replies.guard
        self.settings = settings
        replies.on_change = self.update_label

    # ---- tabs ----------------------------------------------------------------------------
    def views(self) -> list[ChatView]:
        """The chat views in tab order. Walks the panes only: a query over all descendants
        would visit every Markdown block of every chat (the console's redraw calls this)."""
        return [child for pane in self.get_child_by_type(ContentSwitcher).children
                for child in pane.children if isinstance(child, ChatView)]

    @property
    def current(self) -> ChatView | None:
        pane = self.active_pane
        if pane is None:
            return None
        views = list(pane.query(ChatView))
        return views[0] if views else None

    async def new_chat(self, conversation: Conversation | None = None, *, after: str | None = None) -> ChatView:
        conv = conversation or Conversation(
            new_chat_id(), system_prompt=self.settings.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
        )
        view = ChatView(conv)
        pane = TabPane(conv.title, view, id=f"chat-{conv.id}")
        await self.add_pane(pane, after=after)
        self.active = pane.id
        return view

    def update_label(self, conversation: Conversation) -> None:
        """The tab's title, with " ●" while the chat waits for replies."""
        try:
            tab = self.get_tab(f"chat-{conversation.id}")
        except Exception:
            return  # tab closed
        label = conversation.title + (" ●" if self.replies.busy(conversation) else "")
        if tab.label_text != label:
            tab.label = label

    def untouched(self, view: ChatView) -> bool:
        """An empty tab nothing happened in: no messages, never saved, no reply in flight."""
        conv = view.conversation
        return not conv.messages and not conv.saved and not self.replies.busy(conv)

    # ---- sending -------------------------------------------------------------------------
    def sendable(self) -> ChatView | None:
        """The current chat if a prompt can go to it now; else None, and a notification why."""
        chat = self.current
        if chat is None:
            return None
        refusal = self.replies.link.refusal()
        if refusal:
            self.app.notify(refusal, severity="error")
            return None
        if self.replies.busy(chat.conversation):
            self.app.notify("this chat is still replying: Esc stops it, ctrl+n opens another chat",
                        severity="warning")
            return None
        return chat

    async def send(self, chat: ChatView, text: str) -> None:
        """`text` as the chat's next user turn (stored first), then its replies."""
        conv = chat.conversation
        if not any(m.role == "user" for m in conv.messages):
            conv.title = title_from(text)
        msg = StoredMessage("user", text)
        conv.messages.append(msg)
        self.guard.add_message(conv, msg)
        bubble = await chat.add_message(msg)
        bubble.stored = msg  # type: ignore[attr-defined]
        await self.replies.start(chat)

    # ---- actions -------------------------------------------------------------------------
    async def action_new_chat(self) -> None:
        await self.new_chat()

    async def action_close_chat(self) -> None:
        chat = self.current
        if chat is None:
            return
        self.replies.drop(chat.conversation)
        await self.remove_pane(f"chat-{chat.conversation.id}")
        if not self.views():
            await self.new_chat()

    def action_next_chat(self) -> None:
        self._cycle(1)

    def action_previous_chat(self) -> None:
        self._cycle(-1)

    def _cycle(self, step: int) -> None:
        panes = [p.id for p in self.query(TabPane)]
        if not panes or self.active not in panes:
            return
        self.active = panes[(panes.index(self.active) + step) % len(panes)]

    def action_open_chat(self) -> None:
        conversations = self.guard.call("list the saved chats", self.guard.store.list_conversations)
        if conversations is None:
            return  # the notification says why; the open chats are untouched
        self.app.push_screen(OpenChatScreen(conversations), self._open_chosen)

    async def _open_chosen(self, chat_id: str | None) -> None:
        if chat_id:
            await self.open_chat(chat_id)

    async def open_chat(self, chat_id: str) -> ChatView | None:
        """Switch to the chat if it is open, else load it into a new tab (which replaces the
        current tab when that one is untouched)."""
        for view in self.views():
            if view.conversation.id == chat_id:
                self.active = f"chat-{chat_id}"
                return view
        failed = object()
        conv = self.guard.call("load that chat", self.guard.store.load, chat_id, default=failed)
        if conv is failed:
            return None
        if conv is None:
            self.app.notify("that chat no longer exists", severity="error")
            return None
        blank = self.current
        view = await self.new_chat(conv, after=f"chat-{blank.conversation.id}" if blank else None)
        if blank is not None and blank is not view and self.untouched(blank):
            # opened from an empty "New chat" tab: the chat takes its place instead of leaving it
            await self.remove_pane(f"chat-{blank.conversation.id}")
            self.active = f"chat-{conv.id}"
        return view

    def action_system_prompt(self) -> None:
        chat = self.current
        if chat is None:
            return

        def done(text: str | None) -> None:
            if text is None:
                return
            chat.conversation.system_prompt = text
            self.settings.set("system_prompt", text)
            if chat.conversation.saved:  # a failure keeps the new prompt in memory (and in use)
                self.guard.call("save the system prompt", self.guard.store.save_conversation, chat.conversation)
            chat.refresh_system_line()

        self.app.push_screen(SystemPromptScreen(chat.conversation.system_prompt), done)

    def action_copy_reply(self) -> None:
        chat = self.current
        if chat is None:
            return
        conv = chat.conversation
        active = [r for r in self.replies.of(conv) if r.primary]
        if active:
            text = active[0].bubble.text
        else:
            last = [m for m in conv.messages if m.role == "assistant" and not m.meta.get("alt")]
            if not last:
                self.app.notify("no reply to copy yet", severity="warning")
                return
            text = last[-1].content
        self.app.copy_to_clipboard(text)
        self.app.notify(f"copied the reply ({len(text)} characters)", timeout=3)

    async def action_toggle_thinking(self) -> None:
        """Expand or fold the thinking of the reply holding the focus, else of the chat's last
        reply that has a think block."""
        chat = self.current
        if chat is None:
            return
        replies = [b for b in chat.bubbles() if b.has_thinking]
        focused = self.app.focused
        held = [b for b in replies if focused is not None and b in focused.ancestors_with_self]
        if not replies:
            self.app.notify("no reply with thinking in this chat", timeout=3)
            return
        await (held or replies)[-1].toggle_thinking()

    def action_stop(self) -> None:
        chat = self.current
        if chat is not None:
            self.replies.stop(chat.conversation)

    async def action_regenerate(self) -> None:
        chat = self.current
        if chat is None:
            return
        conv = chat.conversation
        if self.replies.busy(conv):
            self.app.notify("wait for the reply to finish (Esc stops it)", severity="warning")
            return
        refusal = self.replies.link.refusal()
        if refusal:
            self.app.notify(refusal, severity="error")
            return
        last_user = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=None)
        if last_user is None:
            self.app.notify("nothing to regenerate yet", severity="warning")
            return
        dropped = conv.messages[last_user + 1:]
        del conv.messages[last_user + 1:]
        ids = [m.id for m in dropped if m.id is not None]
        if ids:  # a failure leaves the old replies on disk; the new one is still generated
            self.guard.call("delete the replaced replies from the store", self.guard.store.delete_messages, conv, ids)
        dropped_ids = {id(m) for m in dropped}
        await chat.remove_bubbles([b for b in chat.bubbles() if id(getattr(b, "stored", None)) in dropped_ids])
        _params, note = self.replies.sampling.replies()
        if note:
            self.app.notify(f"regenerating: {note}", timeout=4)
        await self.replies.start(chat)
