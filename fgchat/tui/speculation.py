"""The console's speculative decoding: the key that cycles it (off → ngram → draft → off), the
title's label ("full+ngram k4") and the panel's line (acceptance, tokens per step, the per-step
time beside the per-token ITL on one axis).

Invariants:
- `draft` is offered only when the engine has a draft model (EngineInfo.draft_model, else the
  configured --draft); without one the cycle goes from ngram back to off and one notice says why.
- What the title shows is what the engine confirmed (EngineInfo.speculate), with a switch asked
  for and not confirmed yet marked "→ngram?", as modes are.
- k is the latest speculated step's draft length (the engine adapts it), else the engine's.
"""

from __future__ import annotations

from textual.content import Content

from fgchat.metrics import histogram, shared_bins, sparkline
from fgchat.metrics.spec_window import SpecFigures
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import EngineInfo

CYCLE = ("off", "ngram", "draft")
NO_DRAFT = "draft needs a draft model: start fgchat with --draft MODEL (same tokenizer)"
HIST_BINS = 24
SPEC_STYLE = "$spec-drafted"  # the theme variable drafted tokens and the spec line are drawn in


class SpecToggle:
    """What speculation the user asked for and how the engine reported it."""

    def __init__(self, configured: str = "off", draft: str | None = None) -> None:
        self.configured = configured or "off"
        self.draft = draft or ""
        self.requested: str | None = None  # asked for, not confirmed by an EngineInfo yet

    def current(self, info: EngineInfo | None) -> str:
        return info.speculate if info is not None else self.configured

    def has_draft(self, info: EngineInfo | None) -> bool:
        return bool((info.draft_model if info is not None else "") or self.draft)

    def next(self, info: EngineInfo | None) -> tuple[str, str]:
        """The method the key switches to, and a notice ("" when none) for a skipped draft."""
        now = self.requested or self.current(info)
        at = CYCLE.index(now) if now in CYCLE else 0
        nxt = CYCLE[(at + 1) % len(CYCLE)]
        if nxt == "draft" and not self.has_draft(info):
            return "off", NO_DRAFT
        return nxt, ""

    def switch(self, link) -> list[tuple[str, str]]:
        """Ask `link`'s engine (tui.engine_link.EngineLink) for the next method; the notices to
        show as (text, severity): a skipped draft, a stopped engine, an endpoint's refusal."""
        refusal = link.refusal()
        if refusal:
            return [(refusal, "error")]
        method, why = self.next(link.info)
        notices = [(why, "warning")] if why else []
        try:
            link.handle.set_speculation(method)
        except FgchatError as exc:
            return [*notices, (str(exc), "warning")]
        self.requested = method
        link.handle.request_info()  # its EngineInfo confirms the method
        return notices

    def confirmed(self, info: EngineInfo) -> None:
        """An EngineInfo arrived: a request it answers is no longer pending."""
        if self.requested == info.speculate:
            self.requested = None

    def label(self, mode: str, info: EngineInfo | None, figures: SpecFigures | None) -> str:
        """"full", "full+ngram k4", "full+off→ngram?"."""
        now = self.current(info)
        label = mode
        if now != "off":
            k = figures.draft_len if figures is not None and figures.method == now and figures.draft_len else (
                info.draft_len if info is not None else 0)
            label = f"{mode}+{now}" + (f" k{k}" if k else "")
        if self.requested and self.requested != now:
            label += f"{'' if now != 'off' else '+off'}→{self.requested}?"
        return label


def spec_line(figures: SpecFigures | None, method: str, width: int = 40) -> Content:
    """The panel's speculation lines; empty while speculation is off and no step was seen."""
    if figures is None:
        if method == "off":
            return Content("")
        return Content.assemble(("spec ", "$text-muted"), (method, f"bold {SPEC_STYLE}"),
                                ("  waiting for a speculated step", "$text-muted"))
    rate = "–" if figures.acceptance_rate is None else f"{figures.acceptance_rate * 100:.0f}%"
    step = "–" if figures.step_ms_mean is None else f"{figures.step_ms_mean:.2f} ms"
    head = Content.assemble(
        ("spec ", "$text-muted"), (f"{figures.method} k{figures.draft_len}", f"bold {SPEC_STYLE}"),
        ("  accept ", "$text-muted"), (rate, "bold"),
        ("  tok/step ", "$text-muted"), (f"{figures.tokens_per_step:.2f}", "bold"),
        ("  step ", "$text-muted"), (step, "bold"),
    )
    bins = max(8, min(HIST_BINS, width - 9))
    series = {"itl": figures.token_itl_ms, "step": figures.step_ms}
    edges = shared_bins(series, bins)
    rows = [head]
    for name, label in (("itl", "ITL/tok "), ("step", "step    ")):
        counts = histogram(series[name], edges)
        bars = sparkline([float(c) if c else None for c in counts], bins, lo=0.0, hi=float(max(counts.max(), 1)))
        rows.append(Content.assemble((label, "$text-muted"), (bars, SPEC_STYLE if name == "itl" else "$accent"),
                                     (f" n={int(counts.sum())}", "$text-muted")))
    lo, hi = float(edges[0]), float(edges[-1])
    rows.append(Content.assemble((f"{'':8}{lo:.2f}–{hi:.2f} ms · last {figures.steps} steps", "$text-muted")))
    return Content("\n").join(rows)
