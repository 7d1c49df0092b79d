"""The command palette (ctrl+p): FgchatApp's system commands and the helpers only they use."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from textual.app import SystemCommand
from textual.screen import Screen
from textual.widgets import Input

from fgchat.protocol.events import MODES
from fgchat.tui.replies import MAX_SAMPLES

EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "prompts.txt"


def example_prompts(path: Path = EXAMPLE_PROMPTS) -> list[str]:
    """Lines of assets/prompts.txt (comments and blanks skipped); [] when it is not there."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


class PaletteMixin:
    """Must precede App in FgchatApp's bases: `get_system_commands` extends App's commands."""

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        available = self.engine_info.available_modes if self.engine_info else {}
        for key, mode in zip(("F1", "F2", "F3"), MODES):
            why = available.get(mode, "")
            help_text = f"Run decode steps in {mode} mode ({key})" + (f" — unavailable: {why}" if why else "")
            yield SystemCommand(f"Mode: {mode}", help_text, lambda m=mode: self.action_mode(m))
        yield SystemCommand("Export latency log (CSV)", "Write the tokens and requests CSVs (ctrl+s)",
                            self.action_export)
        for k in range(1, MAX_SAMPLES + 1):
            yield SystemCommand(f"Replies per prompt: {k}", f"Generate {k} replies at once (batch size {k})",
                                lambda k=k: self.set_samples(k))
        yield SystemCommand("New chat", "Open a new chat tab (ctrl+n)", self.action_new_chat)
        yield SystemCommand("Open saved chat", "Reopen a stored conversation (ctrl+o)", self.action_open_chat)
        yield SystemCommand("Close chat", "Close the current chat tab (it stays saved)", self.action_close_chat)
        yield SystemCommand("Regenerate reply", "Ask again for the last reply (ctrl+r)", self.action_regenerate)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard (ctrl+y)",
                            self.action_copy_reply)
        yield SystemCommand("Edit system prompt", "System prompt of this chat (ctrl+t)", self.action_system_prompt)
        yield SystemCommand("Stop reply", "Stop the replies of this chat (Esc)", self.action_stop)
        yield SystemCommand("Sampling: temperature, top-p, top-k, seed",
                            f"Now {self.sampling_label()} (F6; remembered)", self.action_sampling)
        yield SystemCommand("Sampling: greedy", "Temperature 0 (identical output in every mode; "
                            "K > 1 replies are sampled at T 0.7)", lambda: self.set_sampling(0.0))
        yield SystemCommand("Toggle latency panel", "Show or hide the console (ctrl+l)", self.action_toggle_panel)
        yield SystemCommand("Restart engine", "Start a fresh engine process", self.action_restart_engine)
        yield SystemCommand("Help", "Keys and modes (F10)", self.action_help)
        for text in example_prompts():
            yield SystemCommand(f"Example: {text}", "Put this example prompt in the prompt box",
                                lambda t=text: self._use_example(t))
        for name in self.file_themes:
            yield SystemCommand(f"Theme: {name}", "Switch to this theme (remembered)",
                                lambda n=name: setattr(self, "theme", n))

    def _use_example(self, text: str) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.value = text
        prompt.cursor_position = len(text)
        prompt.focus()

    def set_sampling(self, temperature: float) -> None:
        """Only the temperature changes (top-p, top-k, seed kept); saved like the dialog's."""
        self.set_sampling_params(replace(self.sampling, temperature=temperature))
