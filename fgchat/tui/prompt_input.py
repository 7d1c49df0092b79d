"""The chat's one-line prompt. A paste of several lines does not fit one line (Textual's Input
keeps only the first): the prompt hands the whole text, the paste put where the cursor is, to the
app as `MultilinePaste`, and keeps its own text unchanged."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import Input


class PromptInput(Input):
    class MultilinePaste(Message):
        """The prompt's text with a multi-line paste inserted at the cursor (newlines as "\\n")."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def _on_paste(self, event: events.Paste) -> None:
        pasted = event.text.replace("\r\n", "\n").replace("\r", "\n").rstrip("\n")
        if "\n" not in pasted:
            return  # one line: Input's own handler inserts it
        event.prevent_default()
        event.stop()
        start, end = sorted(self.selection)
        self.post_message(self.MultilinePaste(self.value[:start] + pasted + self.value[end:]))
