"""Small modal dialogs: system prompt editor, open a saved chat, export path."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, TextArea
from textual.widgets.option_list import Option

from fgchat.tui.store import ConversationSummary


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit the system prompt of the current chat; returns the new text or None."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]

    def __init__(self, text: str) -> None:
        super().__init__()
        self._text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("System prompt for this chat (ctrl+s saves, Esc cancels)", classes="dialog-title")
            yield TextArea(self._text, id="system-text", soft_wrap=True)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text)

    def action_cancel(self) -> None:
        self.dismiss(None)


class OpenChatScreen(ModalScreen[str | None]):
    """Pick a saved conversation; returns its id or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, conversations: list[ConversationSummary]) -> None:
        super().__init__()
        self._conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Open a saved chat (Enter opens, Esc cancels)", classes="dialog-title")
            if self._conversations:
                yield OptionList(
                    *[
                        Option(
                            f"{c.title}  ·  {c.message_count} messages  ·  "
                            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(c.updated))}",
                            id=c.id,
                        )
                        for c in self._conversations
                    ],
                    id="chat-list",
                )
            else:
                yield Label("No saved chats yet.", id="chat-list-empty")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ExportScreen(ModalScreen[str | None]):
    """Ask where to write the tokens CSV (the requests CSV goes next to it)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, default_path: str) -> None:
        super().__init__()
        self._default = default_path

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Export the latency log: tokens CSV path (Enter writes, Esc cancels)",
                        classes="dialog-title")
            yield Input(self._default, id="export-path")
            yield Label("A per-request CSV is written next to it (…-requests.csv).", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        value = event.value.strip()
        self.dismiss(value or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
