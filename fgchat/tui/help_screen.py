"""Help: every key binding (read from the app's bindings, so it never goes stale) and the modes."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

MODES_TEXT = """
## Modes
- **eager**: every kernel launched from Python (launch overhead and GPU gaps show).
- **piecewise**: one CUDA graph per segment between attention calls; attention runs eagerly.
- **full**: the whole decode step is one CUDA graph.
- **mega** (F7): every decoder layer runs as one persistent kernel (one program per SM, grid
  barriers between the phases of a layer) inside a CUDA graph; its sums run in another order,
  so near ties may pick other tokens than the other modes.

A switch applies at the next decode step; replies in flight continue. Without a CUDA device
only *eager* runs: asking for another mode is answered with a fallback to eager and the reason.

The latency panel's GPU line compares the GPU time of a step with the host's time to launch it
(*launch*, shown on wide panels): when launching takes three quarters of the GPU time or more,
the mode is host-bound (shown in red) and its latency follows the CPU, not the GPU.

## Batch size
Each reply in flight is one sequence of the engine's batch (1..8). Generate in several chat
tabs at once, or ask for K replies per prompt (F4 / F5), to drive batch sizes 1..8. The K replies
of a prompt are submitted together: prefilled in one round, they decode at batch K from the start.

## Speculative decoding
F9 cycles it live: off → ngram (drafts looked up in the prompt and the reply so far) → draft
(a smaller model with the same tokenizer proposes them; only when fgchat started with --draft)
→ off. The target checks k drafted tokens in one step and keeps those it would have produced
itself, so replies are the same tokens as without it. The title shows it ("full+ngram k4"); the
panel shows the acceptance rate, the mean tokens per step and the per-step time on the axis of
the per-token ITL: accepted drafts arrive together with the step's own token, so ITL turns
bimodal. Accepted drafted text is shown in a subtle colour in the reply.

## Latency log
ctrl+s exports it (tokens CSV + requests CSV). At exit, rows that neither an export nor
--log-csv wrote are kept in <data dir>/latency/<session id>-tokens.csv, and fgchat prints where.

## Pasting
The prompt is one line: a paste of several lines opens in an editor (Enter: new line, ctrl+s
sends the message whole, Esc cancels the paste).

## Sampling
Replies start from the model's own defaults (its generation_config.json; greedy when it has
none; the embedded model: T 0.2, top-p 0.9, as its model card recommends). F6 sets temperature,
top-p, top-k, seed and the repetition, presence and frequency penalties; only the fields you
change from the model's values are remembered, and "Model defaults" forgets them. The title bar shows what applies and where it comes from. Temperature 0
is greedy. Reply j of K uses seed + j; with K > 1 and temperature 0 the K replies are sampled at
temperature 0.7 instead (greedy would give K identical copies); K = 1 keeps your settings.

## Thinking
Models whose chat template takes `enable_thinking` (Qwen3) may open a reply with its reasoning
in a `<think>` block. It is shown folded to one line (its token count, live while it streams);
F8 (or a click on that line) expands or folds it. The setting `thinking` (settings.json, or the
command palette's "Thinking: on / off / template default") is passed to the chat template for
every chat sent; the default leaves it to the template. Thinking tokens are tokens of the reply:
they count in its stats, the latency panel and the CSVs.

## Remote endpoint
When the engine is an OpenAI-compatible server, every timing is measured at the client (the
panel says so) and the server's GPU and launch times are not known; mode keys the server cannot
switch are shown disabled.
"""


def binding_rows(bindings: list[Binding]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for b in bindings:
        text = b.tooltip or b.description
        if not text:
            continue
        keys = ", ".join(k.strip() for k in b.key.split(","))
        rows.append((keys, text))
    return rows


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,f10,q", "dismiss", "Close help"),
    ]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self._app_bindings = bindings

    def compose(self) -> ComposeResult:
        lines = ["# fgchat keys", "", "| key | action |", "|---|---|", "| Enter | send the prompt |"]
        for keys, desc in binding_rows(self._app_bindings):
            lines.append(f"| {keys} | {desc} |")
        lines.append("| ctrl+p | command palette: modes, replies per prompt, themes, export, open/close "
                     "chats, sampling, restart engine |")
        with VerticalScroll(id="help-body"):
            yield Markdown("\n".join(lines) + "\n" + MODES_TEXT + "\n*Esc, F10 or q closes this help.*")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
