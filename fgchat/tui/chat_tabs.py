"""The chat tabs: one `ChatView` per open conversation, and the actions that open, close,
switch and edit them.

Invariants: at least one chat tab is always open; closing a tab cancels and stores its
in-flight replies (finish="cancelled") while the conversation stays saved.
"""

from __future__ import annotations

from textual.widgets import Input, TabbedContent, TabPane

from fgchat.tui.chat_view import ChatView
from fgchat.tui.dialogs import OpenChatScreen, SystemPromptScreen
from fgchat.tui.store import DEFAULT_SYSTEM_PROMPT, Conversation, new_chat_id


class ChatTabsMixin:
    """FgchatApp's tab management (the `#chats` TabbedContent)."""

    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#chats", TabbedContent)

    def chat_views(self) -> list[ChatView]:
        return list(self.query(ChatView))

    @property
    def current_chat(self) -> ChatView | None:
        pane = self.tabs.active_pane
        if pane is None:
            return None
        views = list(pane.query(ChatView))
        return views[0] if views else None

    def chat_busy(self, conversation: Conversation) -> bool:
        return any(r.conversation is conversation for r in self.replies.values())

    async def new_chat(self, conversation: Conversation | None = None, *, after: str | None = None) -> ChatView:
        conv = conversation or Conversation(
            new_chat_id(), system_prompt=self.settings.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
        )
        view = ChatView(conv)
        pane = TabPane(conv.title, view, id=f"chat-{conv.id}")
        await self.tabs.add_pane(pane, after=after)
        self.tabs.active = pane.id
        return view

    def _update_tab(self, conversation: Conversation) -> None:
        pane_id = f"chat-{conversation.id}"
        try:
            tab = self.tabs.get_tab(pane_id)
        except Exception:
            return  # tab closed
        label = conversation.title + (" ●" if self.chat_busy(conversation) else "")
        if tab.label_text != label:
            tab.label = label

    async def action_new_chat(self) -> None:
        await self.new_chat()
        self.query_one("#prompt", Input).focus()

    def action_copy_reply(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        conv = chat.conversation
        active = [r for r in self.replies.values() if r.conversation is conv and r.primary]
        if active:
            text = active[0].bubble.text
        else:
            last = [m for m in conv.messages if m.role == "assistant" and not m.meta.get("alt")]
            if not last:
                self.notify("no reply to copy yet", severity="warning")
                return
            text = last[-1].content
        self.copy_to_clipboard(text)
        self.notify(f"copied the reply ({len(text)} characters)", timeout=3)

    def action_open_chat(self) -> None:
        conversations = self._store_call("list the saved chats", self.store.list_conversations)
        if conversations is None:
            return  # the notification says why; the open chats are untouched
        self.push_screen(OpenChatScreen(conversations), self._open_chosen)

    async def _open_chosen(self, chat_id: str | None) -> None:
        if not chat_id:
            return
        await self.open_chat(chat_id)

    async def open_chat(self, chat_id: str) -> ChatView | None:
        for view in self.chat_views():
            if view.conversation.id == chat_id:
                self.tabs.active = f"chat-{chat_id}"
                return view
        failed = object()
        conv = self._store_call("load that chat", self.store.load, chat_id, default=failed)
        if conv is failed:
            return None
        if conv is None:
            self.notify("that chat no longer exists", severity="error")
            return None
        blank = self.current_chat
        view = await self.new_chat(conv, after=f"chat-{blank.conversation.id}" if blank else None)
        if blank is not None and blank is not view and self.untouched(blank):
            # opened from an empty "New chat" tab: the chat takes its place instead of leaving it
            await self.tabs.remove_pane(f"chat-{blank.conversation.id}")
            self.tabs.active = f"chat-{conv.id}"
        return view

    def untouched(self, view: ChatView) -> bool:
        """An empty tab nothing happened in: no messages, never saved, no reply in flight."""
        conv = view.conversation
        return not conv.messages and not conv.saved and not self.chat_busy(conv)

    async def action_close_chat(self) -> None:
        chat = self.current_chat
        if chat is None:
            return
        conv = chat.conversation
        for reply in list(self.replies.values()):
            if reply.conversation is conv:
                self.engine.cancel(reply.rid)
                self._persist_reply(reply, reply.bubble.text,
                                    {"finish": "cancelled", "tokens": reply.tokens})
                del self.replies[reply.rid]
        await self.tabs.remove_pane(f"chat-{conv.id}")
        if not self.chat_views():
            await self.new_chat()

    def action_system_prompt(self) -> None:
        chat = self.current_chat
        if chat is None:
            return

        def done(text: str | None) -> None:
            if text is None:
                return
            chat.conversation.system_prompt = text
            self.settings.set("system_prompt", text)
            if chat.conversation.saved:  # a failure keeps the new prompt in memory (and in use)
                self._store_call("save the system prompt", self.store.save_conversation,
                                 chat.conversation)
            chat.refresh_system_line()

        self.push_screen(SystemPromptScreen(chat.conversation.system_prompt), done)

    def action_next_chat(self) -> None:
        self._cycle_chat(1)

    def action_previous_chat(self) -> None:
        self._cycle_chat(-1)

    def _cycle_chat(self, step: int) -> None:
        panes = [p.id for p in self.tabs.query(TabPane)]
        if not panes or self.tabs.active not in panes:
            return
        self.tabs.active = panes[(panes.index(self.tabs.active) + step) % len(panes)]
