"""Small modal dialogs: system prompt editor, a message of several lines, open a saved chat,
export path, sampling."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, TextArea
from textual.validation import Function
from textual.widgets.option_list import Option

from fgchat.protocol.events import SEED_SPACE, SamplingParams
from fgchat.tui.sampling import K_TEMPERATURE
from fgchat.tui.store import ConversationSummary


class _SaveOrCancel:
    """Save / Cancel buttons of a dialog: Save runs the screen's action_save, Cancel (or Esc)
    dismisses it with None."""

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()  # type: ignore[attr-defined]
        else:
            self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)  # type: ignore[attr-defined]


class SystemPromptScreen(_SaveOrCancel, ModalScreen[str | None]):
    """Edit the system prompt of the current chat; returns the new text or None."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]
    HEADING = "System prompt for this chat (ctrl+s saves, Esc cancels)"
    SAVE_LABEL = "Save"

    def __init__(self, text: str) -> None:
        super().__init__()
        self._text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.HEADING, classes="dialog-title")
            yield TextArea(self._text, id="system-text", soft_wrap=True)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.SAVE_LABEL, id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text)


class MessageScreen(SystemPromptScreen):
    """A message of several lines (a multi-line paste, which the one-line prompt cannot hold):
    returns the text to send, or None."""

    HEADING = "Message of several lines (Enter: new line, ctrl+s sends, Esc cancels)"
    SAVE_LABEL = "Send"

    def on_mount(self) -> None:
        area = self.query_one(TextArea)
        area.move_cursor(area.document.end)  # typing goes on after the paste


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


# ---- sampling ------------------------------------------------------------------------------------


def _parse_float(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _parse_int(text: str) -> int:
    return int(text.strip())


# field id -> (label, parser, check, what a valid value is); the same ranges as SamplingParams.validate
SAMPLING_FIELDS: dict[str, tuple[str, object, object, str]] = {
    "temperature": ("Temperature", _parse_float, lambda v: 0.0 <= v <= 100.0,
                    "temperature: a number from 0 (greedy) to 100"),
    "top_p": ("Top-p", _parse_float, lambda v: 0.0 < v <= 1.0,
              "top-p: a number in (0, 1] (1 disables it)"),
    "top_k": ("Top-k", _parse_int, lambda v: v >= 0,
              "top-k: a whole number >= 0 (0 disables it)"),
    "seed": ("Seed", _parse_int, lambda v: 0 <= v < SEED_SPACE,
             "seed: a whole number in [0, 2^63); reply j of K uses seed + j"),
    "repetition_penalty": ("Repetition pen.", _parse_float, lambda v: 0.0 < v <= 10.0,
                           "repetition penalty: a number in (0, 10] (1 disables it)"),
    "presence_penalty": ("Presence pen.", _parse_float, lambda v: -2.0 <= v <= 2.0,
                         "presence penalty: a number in [-2, 2] (0 disables it)"),
    "frequency_penalty": ("Frequency pen.", _parse_float, lambda v: -2.0 <= v <= 2.0,
                          "frequency penalty: a number in [-2, 2] (0 disables it)"),
}


def sampling_texts(p: SamplingParams) -> dict[str, str]:
    """The dialog's field texts for `p`."""
    return {name: f"{getattr(p, name):g}" if isinstance(getattr(p, name), float) else str(getattr(p, name))
            for name in SAMPLING_FIELDS}


def parse_sampling(values: dict[str, str], base: SamplingParams) -> SamplingParams:
    """`base` with the dialog's fields (values missing from `values` keep base's); ValueError
    (one line naming the first bad field and what it accepts) when one is not valid."""
    parsed: dict[str, float | int] = {}
    for name, (_label, parse, check, what) in SAMPLING_FIELDS.items():
        if name not in values:
            continue
        text = values[name]
        try:
            value = parse(text)  # type: ignore[operator]
        except (ValueError, OverflowError):
            raise ValueError(f"invalid {what}, got {text.strip()!r}") from None
        if not check(value):  # type: ignore[operator]
            raise ValueError(f"invalid {what}, got {text.strip()!r}")
        parsed[name] = value
    return replace(base, **parsed)  # type: ignore[arg-type]


def _field_ok(name: str, text: str) -> bool:
    _label, parse, check, _what = SAMPLING_FIELDS[name]
    try:
        return bool(check(parse(text)))  # type: ignore[operator]
    except (ValueError, OverflowError):
        return False


class SamplingScreen(_SaveOrCancel, ModalScreen[SamplingParams | None]):
    """The sampling fields of SAMPLING_FIELDS, shown with the effective values; "Model defaults"
    fills in the model's own (`defaults`, described by `source`). Returns the new
    SamplingParams or None (cancelled). An invalid value keeps the dialog open with a one-line
    error."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]

    DEFAULT_CSS = """
    SamplingScreen .sampling-row {
        height: auto;
        margin-bottom: 1;
    }
    SamplingScreen .sampling-row Label {
        width: 17;
        padding: 0 1 0 0;
    }
    SamplingScreen .sampling-row Input {
        width: 1fr;
    }
    SamplingScreen #sampling-error {
        color: $error;
        height: 1;
    }
    """

    def __init__(self, params: SamplingParams, defaults: SamplingParams | None = None, source: str = "") -> None:
        super().__init__()
        self._params = params
        self._defaults = defaults if defaults is not None else SamplingParams()
        self._source = source

    def compose(self) -> ComposeResult:
        current = sampling_texts(self._params)
        with Vertical(classes="dialog"):
            yield Label("Sampling (Enter or ctrl+s saves, Esc cancels)", classes="dialog-title")
            for name, (label, _parse, _check, what) in SAMPLING_FIELDS.items():
                with Horizontal(classes="sampling-row"):
                    yield Label(label)
                    yield Input(
                        current[name], id=f"sampling-{name.replace('_', '-')}", compact=True,
                        validators=[Function(lambda v, n=name: _field_ok(n, v), what)],
                        validate_on=["changed", "submitted"],
                    )
            yield Label("", id="sampling-error")
            yield Label(f"Model defaults: {self._source or 'greedy (the model sets none)'}. Only the "
                        "fields you change from them are saved; the others follow the model. "
                        f"With K > 1 replies and temperature 0 the K replies are sampled at "
                        f"temperature {K_TEMPERATURE:g} (greedy would give K copies); reply j uses seed + j.",
                        classes="dialog-hint")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Model defaults", id="defaults")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#sampling-temperature", Input).focus()

    def values(self) -> dict[str, str]:
        return {name: self.query_one(f"#sampling-{name.replace('_', '-')}", Input).value
                for name in SAMPLING_FIELDS}

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """"Model defaults" fills the fields; Save and Cancel go on to _SaveOrCancel's handler
        (Textual runs the handlers of the whole MRO unless one prevents the default)."""
        if event.button.id == "defaults":
            event.prevent_default()
            for name, text in sampling_texts(self._defaults).items():
                self.query_one(f"#sampling-{name.replace('_', '-')}", Input).value = text

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def action_save(self) -> None:
        error = self.query_one("#sampling-error", Label)
        try:
            params = parse_sampling(self.values(), self._params)
            params.validate()
        except Exception as exc:  # ValueError from parsing, RequestError from validate
            error.update(Content(" ".join(str(exc).split())[:200]))  # plain text, no markup
            return
        error.update(Content(""))
        self.dismiss(params)
