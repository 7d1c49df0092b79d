"""The app's key bindings: modes, replies per prompt, sampling, chat actions (run by ChatTabs
through `FgchatApp.action_chat`), export, panel, help and quit. The help screen lists them."""

from __future__ import annotations

from textual.binding import Binding


def _chat(action: str) -> str:
    """A binding's action string for a ChatTabs action (see `FgchatApp.action_chat`)."""
    return f"chat('{action}')"


THINK_KEY = "f8"  # expands / folds a reply's thinking; its folded line names the key
THINK_KEY_LABEL = "F8"


APP_BINDINGS: list[Binding] = [
    Binding("escape", _chat("stop"), "Stop", tooltip="Stop the replies of the current chat (partial text is kept)"),
    Binding("f1", "mode('eager')", "Eager", group=Binding.Group("Mode", compact=True),
            tooltip="Mode eager: every kernel launched from Python"),
    Binding("f2", "mode('piecewise')", "Piecewise", group=Binding.Group("Mode", compact=True),
            tooltip="Mode piecewise: CUDA graphs between attention calls"),
    Binding("f3", "mode('full')", "Full", group=Binding.Group("Mode", compact=True),
            tooltip="Mode full: the whole decode step as one CUDA graph"),
    Binding("f7", "mode('mega')", "Mega", group=Binding.Group("Mode", compact=True),
            tooltip="Mode mega: every decoder layer as one persistent kernel, in one CUDA graph"),
    Binding("f4", "samples(1)", "K+1", group=Binding.Group("Replies", compact=True),
            tooltip="Ask for one more reply per prompt (K = 1..8 replies generated as one batch)"),
    Binding("f5", "samples(-1)", "K-1", group=Binding.Group("Replies", compact=True),
            tooltip="Ask for one reply fewer per prompt"),
    Binding(THINK_KEY, _chat("toggle_thinking"), "Think", show=False,  # its folded line names the key
            tooltip="Expand or fold the thinking (<think> block) of the focused reply, else of this chat's last one"),
    Binding("f9", "speculate", "Spec", show=False,  # the footer fits 120 columns; help lists it
            tooltip="Speculative decoding: off → ngram (prompt lookup) → draft (a draft model, --draft) → off"),
    Binding("f6", "sampling", "Sampling",
            tooltip="Sampling: temperature, top-p, top-k, seed, penalties (the model's defaults unless you change them)"),
    Binding("ctrl+n", _chat("new_chat"), "New", tooltip="New chat tab (chats can generate at the same time)"),
    Binding("ctrl+r", _chat("regenerate"), "Regen", tooltip="Regenerate the last reply of this chat"),
    Binding("ctrl+s", "export", "Export", tooltip="Export the latency log: tokens CSV + requests CSV"),
    Binding("ctrl+y", _chat("copy_reply"), "Copy", show=False, tooltip="Copy the last reply to the clipboard"),
    Binding("ctrl+o", _chat("open_chat"), "Open", tooltip="Reopen a saved conversation"),
    Binding("ctrl+t", _chat("system_prompt"), "System", show=False, tooltip="Edit this chat's system prompt"),
    Binding("ctrl+l", "toggle_panel", "Panel", show=False, tooltip="Show or hide the latency console"),
    # priority: the prompt Input (a ScrollView) binds these keys to horizontal paging and
    # takes them whenever its text or placeholder is wider than it (narrow terminals)
    Binding("ctrl+pagedown", _chat("next_chat"), "Next", show=False, priority=True, tooltip="Next chat tab"),
    Binding("ctrl+pageup", _chat("previous_chat"), "Prev", show=False, priority=True,
            tooltip="Previous chat tab"),
    Binding("f10", "help", "Help", tooltip="This help"),
    Binding("ctrl+q", "quit", "Quit", priority=True,
            tooltip="Quit (replies in flight are stored as interrupted)"),
]
