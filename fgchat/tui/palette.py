"""The command palette (ctrl+p): fgchat's system commands, built from the app's components."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import SystemCommand

from fgchat.protocol.events import MODES
from fgchat.tui.sampling import K_TEMPERATURE, MAX_SAMPLES
from fgchat.tui.thinking import THINKING_LABELS

if TYPE_CHECKING:
    from fgchat.tui.app import FgchatApp

EXAMPLE_PROMPTS = Path(__file__).resolve().parent / "prompts.txt"


def example_prompts(path: Path = EXAMPLE_PROMPTS) -> list[str]:
    """Lines of tui/prompts.txt (comments and blanks skipped); [] when it is not there."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def fgchat_commands(app: FgchatApp) -> Iterator[SystemCommand]:
    """Every fgchat command of the palette, in the order shown."""
    unavailable = app.link.unavailable_modes()
    for key, mode in zip(("F1", "F2", "F3", "F7"), MODES):
        why = unavailable.get(mode, "")
        help_text = f"Run decode steps in {mode} mode ({key})" + (f" — unavailable: {why}" if why else "")
        yield SystemCommand(f"Mode: {mode}", help_text, lambda m=mode: app.action_mode(m))
    yield SystemCommand("Export latency log (CSV)", "Write the tokens and requests CSVs (ctrl+s)", app.action_export)
    for k in range(1, MAX_SAMPLES + 1):
        yield SystemCommand(f"Replies per prompt: {k}", f"Generate {k} replies at once (batch size {k})",
                            lambda k=k: app.set_samples(k))
    chats = app.chats
    yield SystemCommand("New chat", "Open a new chat tab (ctrl+n)", chats.action_new_chat)
    yield SystemCommand("Open saved chat", "Reopen a stored conversation (ctrl+o)", chats.action_open_chat)
    yield SystemCommand("Close chat", "Close the current chat tab (it stays saved)", chats.action_close_chat)
    yield SystemCommand("Regenerate reply", "Ask again for the last reply (ctrl+r)", chats.action_regenerate)
    yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard (ctrl+y)", chats.action_copy_reply)
    yield SystemCommand("Edit system prompt", "System prompt of this chat (ctrl+t)", chats.action_system_prompt)
    yield SystemCommand("Stop reply", "Stop the replies of this chat (Esc)", chats.action_stop)
    yield SystemCommand("Sampling: temperature, top-p, top-k, seed",
                        f"Now {app.sampling.label()} (F6; penalties too; remembered)", app.action_sampling)
    yield SystemCommand("Sampling: greedy", "Temperature 0 (identical output in every mode; "
                        f"K > 1 replies are sampled at T {K_TEMPERATURE:g})",
                        lambda: app.set_sampling_params(replace(app.sampling.params, temperature=0.0)))
    yield SystemCommand("Sampling: model defaults", f"Forget your sampling settings: {app.sampling.source or 'greedy'}",
                        app.reset_sampling)
    now = THINKING_LABELS[app.sampling.thinking]
    for value, label in THINKING_LABELS.items():
        yield SystemCommand(f"Thinking: {label}", f"The chat template's enable_thinking for the chats sent (now {now}; "
                            "remembered)", lambda v=value: app.set_thinking(v))
    yield SystemCommand("Toggle latency panel", "Show or hide the console (ctrl+l)", app.action_toggle_panel)
    yield SystemCommand("Restart engine", "Start a fresh engine process", app.action_restart_engine)
    yield SystemCommand("Help", "Keys and modes (F10)", app.action_help)
    for text in example_prompts():
        yield SystemCommand(f"Example: {text}", "Put this example prompt in the prompt box",
                            lambda t=text: app.use_example(t))
    for name in app.file_themes:
        yield SystemCommand(f"Theme: {name}", "Switch to this theme (remembered)",
                            lambda n=name: setattr(app, "theme", n))
