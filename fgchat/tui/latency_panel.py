"""The latency console: mode and batch size, per-mode histograms, TTFT/TPOT/ITL, GPU vs host,
tokens per second, a sparkline of recent inter-token latencies, graph capture cost.

The app's `LatencyConsole` computes a `PanelView` at most ~10 times a second (coalesced) and
hands it over; the panel only formats. Nothing here touches the engine. A redraw lays the screen
out only when a line's shape changes (its line count, the panel's width, a line that wraps) or
the histograms' height does; otherwise it only repaints (a layout visits every widget on screen).

With a remote endpoint (EngineInfo.endpoint) every timing is measured at the client: the panel
says so on its first line, and lines whose figures the server does not report (GPU time, launch
time) are hidden instead of shown empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.cells import cell_len
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from fgchat.metrics.spec_window import SpecFigures
from fgchat.protocol.events import MODES, CaptureReport, EngineInfo, Mode
from fgchat.metrics import bandwidth_share, host_bound, sparkline
from fgchat.tui.histogram import MODE_STYLES, ModeHistograms, fmt_ms
from fgchat.tui.speculation import spec_line

MODE_KEYS = {Mode.EAGER: "F1", Mode.PIECEWISE: "F2", Mode.FULL: "F3", Mode.MEGA: "F7"}
HIDEABLE = frozenset({"timing-note", "mode-note", "spec-line", "gpu-host", "weights-line", "export-line"})  # hidden when empty


@dataclass
class PanelView:
    """Everything the panel shows, computed by the app from the latency log."""

    mode: str = "eager"  # the mode the engine reports
    ran_mode: str = ""  # the mode of the latest decode step ("" before one; EngineLink.ran_mode)
    requested_mode: str | None = None  # asked for, not confirmed yet (or refused: see note)
    mode_note: str = ""  # e.g. "full unavailable: CUDA graphs need a CUDA device"
    unavailable: tuple[tuple[str, str], ...] = ()  # (mode, why it cannot run; "" when it can)
    batch_size: int = 0  # sequences in the latest decode step; 0 when idle
    last_batch_size: int = 0
    samples: int = 1  # replies asked for per prompt (K)
    sampling: str = ""  # effective sampling and its source, e.g. "T 0.7 top-p 0.8 … · generation_config.json"
    active_replies: int = 0
    summary: dict[str, Any] = field(default_factory=dict)  # fgchat.metrics.summarize_records output
    itl_by_mode: dict[str, np.ndarray] = field(default_factory=dict)
    recent_itl: list[float] = field(default_factory=list)
    windowed: int = 0  # > 0: stats cover only the latest `windowed` tokens
    total_tokens: int = 0
    info: EngineInfo | None = None
    engine_state: str = "starting"  # starting | ready | failed
    engine_error: str = ""
    engine_phase: str = ""  # what a starting engine is doing (EngineProgress)
    starting_s: float = 0.0  # seconds since the engine was started
    ready_s: float | None = None  # seconds from launch (or restart) to the engine being ready
    last_export: str = ""  # path of the latest ctrl+s export (tokens CSV); "" before any
    recent_gpu_ms: float | None = None  # mean GPU time of the latest decode steps; None without GPU timing
    speculate: str = "off"  # the speculation method the engine reports
    spec: SpecFigures | None = None  # the latest speculated steps (None before any)


def _indent(text: str, indent: int, width: int) -> str:
    """Indent `text` by up to `indent` spaces, less when the line would not fit `width`."""
    return " " * max(0, min(indent, width - len(text))) + text


class LatencyPanel(VerticalScroll):
    """Right-hand console; `show(view)` redraws only what changed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = PanelView()
        self._texts: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, int, bool]] = {}  # per line: (lines, width, too wide)

    def compose(self) -> ComposeResult:
        yield Static(id="timing-note")
        yield Static(id="mode-bar")
        yield Static(id="batch-line")
        yield Static(id="mode-note")
        yield Static("ITL per mode, one axis", id="hist-title", classes="section")
        yield ModeHistograms(id="histograms")
        yield Static(id="spec-line")
        yield Static(id="stats")
        yield Static(id="throughput")
        yield Static(id="gpu-host")
        yield Static(id="weights-line")
        yield Static(id="spark")
        yield Static(id="captures")
        yield Static(id="engine-info")
        yield Static(id="export-line")

    def on_resize(self) -> None:
        """Re-layout for the new width/height at once, also while idle (no new tokens)."""
        self.show(self.view)

    def content_width(self) -> int:
        """Columns for text: scrollable_content_region's width, from the size the last layout
        gave this widget (asking the compositor for the region can rebuild the whole screen's
        map after any off-screen widget changed)."""
        return max(0, self.outer_size.width - self.styles.gutter.width - self.scrollbar_gutter.width)

    # ---- formatting ---------------------------------------------------------------------
    def show(self, view: PanelView) -> None:
        self.view = view
        available = dict(view.unavailable)
        columns = self.content_width()  # 0 before the first layout
        width = columns or 40
        endpoint = view.info.endpoint if view.info else ""
        self._set("timing-note", self._timing_note(endpoint), columns)
        self._set("mode-bar", self._mode_bar(view, available, width), columns)
        self._set("batch-line", self._batch_line(view, width), columns)
        self._set("mode-note", self._note(view), columns)
        hist = self.query_one(ModeHistograms)
        height = self.app.size.height
        hist.rows_per_mode = 1 if height < 34 else (2 if height < 50 else 3)
        hist.set_data(view.itl_by_mode, available, view.ran_mode or view.mode, chosen_mode=view.mode)
        self._set("spec-line", spec_line(view.spec, view.speculate, width), columns)
        self._set("stats", self._stats(view.summary, width), columns)
        self._set("throughput", self._throughput(view), columns)
        self._set("gpu-host", Content("") if endpoint and self._no_server_timing(view.summary)
                  else self._gpu_host(view.summary, width), columns)
        self._set("weights-line", self._weights_line(view, width), columns)
        self._set("spark", self._spark(view.recent_itl, width), columns)
        self._set("captures", self._captures(view.info), columns)
        self._set("engine-info", self._engine_info(view), columns)
        self._set("export-line", self._export_line(view.last_export, width), columns)

    def _set(self, widget_id: str, content: Content, width: int) -> None:
        """Show `content` in a line's Static; `width` is `content_width()` as `show` measured it.
        A layout of the screen only when its shape (lines, width) changed or a line wraps: most
        redraws only change numbers."""
        key = content.markup if isinstance(content, Content) else str(content)
        if self._texts.get(widget_id) == key:
            return
        self._texts[widget_id] = key
        lines = content.plain.split("\n")
        shape = (len(lines), width, any(cell_len(line) > width for line in lines))
        widget = self.query_one(f"#{widget_id}", Static)
        widget.update(content, layout=shape[2] or self._shapes.get(widget_id) != shape)
        self._shapes[widget_id] = shape
        widget.display = bool(content.plain.strip()) or widget_id not in HIDEABLE

    def text_of(self, widget_id: str) -> str:
        """Plain text currently shown by one of the panel's lines (tests, screenshots)."""
        widget = self.query_one(f"#{widget_id}", Static)
        visual = widget.visual
        return getattr(visual, "plain", str(visual))

    @staticmethod
    def _mode_bar(view: PanelView, available: dict[str, str], width: int = 60) -> Content:
        """One line: the longest labels that fit `width` (key, mode and "n/a"; mode and "n/a";
        mode). The keys go first: the footer and the help list them too."""
        variants = (
            lambda m: f" {MODE_KEYS[m]} {m}{' n/a' if available.get(m) else ''} ",
            lambda m: f" {m}{' n/a' if available.get(m) else ''} ",
            lambda m: f" {m} ",
        )
        for make in variants:
            labels = [make(mode) for mode in MODES]
            if sum(len(label) + 1 for label in labels) <= width:
                break
        parts: list[Content | tuple[str, str] | str] = []
        for mode, label in zip(MODES, labels):
            unavailable = bool(available.get(mode))
            if mode == view.mode:
                style = f"bold reverse {MODE_STYLES[mode]}"
            elif unavailable:
                style = "$text-muted strike"
            else:
                style = MODE_STYLES[mode]
            parts.append((label, style))
            parts.append(" ")
        return Content.assemble(*parts)

    @staticmethod
    def _batch_line(view: PanelView, width: int = 60) -> Content:
        if view.batch_size:
            batch = (f"batch size {view.batch_size}", "bold $accent")
        else:
            last = f", last {view.last_batch_size}" if view.last_batch_size and width >= 44 else ""
            batch = (f"batch size 0 (idle{last})", "$text-muted")
        if width < 38:
            batch = (batch[0].replace(" (idle)", ""), batch[1])
            return Content.assemble(
                (view.mode, f"bold {MODE_STYLES.get(view.mode, '')}"), (" · ", "$text-muted"), batch,
                (" · K ", "$text-muted"), (str(view.samples), "bold"),
            )
        return Content.assemble(
            ("mode ", "$text-muted"), (view.mode, f"bold {MODE_STYLES.get(view.mode, '')}"),
            ("  ", ""), batch, ("  ", ""), ("K ", "$text-muted"), (str(view.samples), "bold"),
        )

    @staticmethod
    def _timing_note(endpoint: str) -> Content:
        if not endpoint:
            return Content("")
        return Content.assemble(("timings measured at client", "bold $warning"),
                                (" (remote endpoint)", "$text-muted"))

    @staticmethod
    def _no_server_timing(s: dict[str, Any]) -> bool:
        return s.get("gpu_step_ms_mean") is None and s.get("launch_ms_mean") is None

    @staticmethod
    def _note(view: PanelView) -> Content:
        if view.engine_state == "failed":
            return Content.assemble(("engine stopped: ", "bold $error"), (view.engine_error, "$error"))
        if view.requested_mode and view.requested_mode != view.mode and not view.mode_note:
            return Content.assemble((f"switching to {view.requested_mode}…", "$warning"))
        if view.mode_note:
            return Content.assemble(("⚠ ", "$warning"), (view.mode_note, "$warning"))
        return Content("")

    @staticmethod
    def _stats(s: dict[str, Any], width: int = 60) -> Content:
        wide = width >= 36
        lw, cw = (8, 7) if wide else (5, 7 if width >= 33 else 6)
        head = f"{'' if wide else 'ms':<{lw}}" + "".join(f"{h:>{cw}}" for h in ("mean", "p50", "p90", "p99"))
        rows: list[Content] = [Content.assemble((head, "bold $text-muted"))]
        for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
            cells = "".join(f"{fmt_ms(s.get(f'{key}_ms_{st}')):>{cw}}" for st in ("mean", "p50", "p90", "p99"))
            name = f"{label} ms" if wide else label
            rows.append(Content.assemble((f"{name:<{lw}}", "bold"), cells))
        return Content("\n").join(rows)

    @staticmethod
    def _throughput(view: PanelView) -> Content:
        s = view.summary
        per_seq = s.get("tokens_per_s")
        total = s.get("throughput_tokens_per_s")
        text = (
            f"tok/s {per_seq:.1f} per seq" if per_seq else "tok/s –"
        ) + (f" · {total:.1f} all" if total else "")
        scope = f" (last {view.windowed})" if view.windowed else ""
        return Content.assemble((text, "bold"), (f"  {view.total_tokens} tokens{scope}", "$text-muted"))

    @staticmethod
    def _gpu_host(s: dict[str, Any], width: int = 60) -> Content:
        gpu, host, frac = s.get("gpu_step_ms_mean"), s.get("host_overhead_ms_mean"), s.get("gpu_fraction")
        if gpu is None:
            launch = s.get("launch_ms_mean")
            if launch is not None:  # CPU: the step runs on the host; show its mean time per step
                why = " (CPU, no GPU timing)" if width >= 44 else " (CPU)" if width >= 30 else ""
                return Content.assemble(("host/step ", "$text-muted"), (f"{fmt_ms(launch)} ms", "bold $warning"),
                                        (why, "$text-muted"))
            why = "(no GPU timing on CPU)" if width >= 42 else "(no GPU timing)"
            return Content.assemble(("GPU/step – host – ", ""), (why, "$text-muted"))
        pct = f" ({frac * 100:.0f}% GPU)" if frac is not None else ""
        launch = s.get("launch_ms_mean")
        launch_part = [] if launch is None or width < 64 else [
            ("  launch ", "$text-muted"),
            (f"{fmt_ms(launch)} ms", "bold $error" if host_bound(launch, gpu) else "$text"),
        ]
        return Content.assemble(
            ("GPU/step ", "$text-muted"), (f"{fmt_ms(gpu)} ms", "bold $success"),
            ("  host ", "$text-muted"), (f"{fmt_ms(host)} ms", "bold $warning"), (pct, "$text-muted"),
            *launch_part,
        )

    @staticmethod
    def _weights_line(view: PanelView, width: int = 60) -> Content:
        """The bytes of weights a decode step reads (once per step at any batch size) and the
        share of the GPU's peak memory bandwidth the latest steps reached: n/a without a known
        peak (CPU, an unknown GPU) or before a step; nothing for a remote endpoint."""
        info = view.info
        if info is None or info.endpoint or not info.step_bytes:
            return Content("")
        mb = f"{info.step_bytes / 1e6:.1f} MB"
        share = bandwidth_share(info.step_bytes, view.recent_gpu_ms, info.peak_bandwidth)
        if info.peak_bandwidth is None:
            rest = [("  bandwidth ", "$text-muted"), ("n/a", "$text-muted")]
        elif share is None:
            rest = [("  bandwidth ", "$text-muted"), ("–", "")]
        else:
            peak = f" of {info.peak_bandwidth / 1e12:.2f} TB/s" if width >= 50 else ""
            rest = [("  ", ""), (f"{share * 100:.0f}%", "bold $success"), (f"{peak} peak BW", "$text-muted")]
        label = "weights read/step " if width >= 44 else "weights/step "
        return Content.assemble((label, "$text-muted"), (mb, "bold"), *rest)

    def _spark(self, recent: list[float], panel_width: int = 40) -> Content:
        width = max(8, panel_width - 11)
        if not recent:
            return Content.assemble(("ITL recent ", "$text-muted"), ("waiting for tokens", "$text-muted"))
        line = sparkline(recent, width)
        shown = [v for v in recent[-width:] if v is not None]
        lo, hi = (min(shown), max(shown)) if shown else (0.0, 0.0)
        return Content.assemble(
            ("ITL recent ", "$text-muted"), (line, "$accent"),
            ("\n", ""), (_indent(f"{fmt_ms(lo)}–{fmt_ms(hi)} ms · last {fmt_ms(recent[-1])}", 11, panel_width),
                          "$text-muted"),
        )

    @staticmethod
    def _captures(info: EngineInfo | None) -> Content:
        if info is None:
            return Content("")
        reports: list[CaptureReport] = list(info.captures)
        if not reports:
            return Content.assemble(("graphs ", "$text-muted"), ("none captured", "$text-muted"),
                                    *LatencyPanel._check_parts(info))
        parts: list[Any] = [("graphs", "$text-muted")]
        for mode in (Mode.PIECEWISE, Mode.FULL, Mode.MEGA):
            mine = [r for r in reports if r.mode == mode and r.kind == "decode"]
            if mine:
                secs = sum(r.seconds for r in mine)
                mib = sum(r.pool_mib for r in mine)
                parts.append((f"\n {mode:<9} {len(mine)} sizes {secs:.2f} s {mib:.0f} MiB", MODE_STYLES[mode]))
        pre = [r for r in reports if r.kind == "prefill"]
        if pre:
            secs, mib = sum(r.seconds for r in pre), sum(r.pool_mib for r in pre)
            parts.append((f"\n prefill   {len(pre)} lengths {secs:.2f} s {mib:.0f} MiB", MODE_STYLES[Mode.FULL]))
        if info.kernel_warmup_s is not None:
            parts.append((f"\n kernels  warmed in {info.kernel_warmup_s:.2f} s", "$text-muted"))
        parts.extend(LatencyPanel._check_parts(info))
        return Content.assemble(*parts)

    @staticmethod
    def _check_parts(info: EngineInfo) -> list[Any]:
        """The start-up check against float32: passed (muted) or failed and what runs instead."""
        sc = info.startup_check
        if sc is None:
            return [("\n check    vs float32 pending (runs before the first reply)", "$text-muted")] \
                if info.startup_check_pending else []
        if sc.passed:
            return [(f"\n check    vs float32 ok, err {sc.max_rel_err:.3f}, {sc.seconds:.2f} s", "$text-muted")]
        return [(f"\n check    FAILED vs float32: running {sc.fallback or sc.path}", "$warning")]

    @staticmethod
    def _export_line(path: str, width: int = 40) -> Content:
        """"exported …/exports/fgchat-…-tokens.csv", the path's tail when it does not fit."""
        if not path:
            return Content("")
        label = "exported "
        room = max(8, width - len(label))
        shown = path if len(path) <= room else "…" + path[-(room - 1):]
        return Content.assemble((label, "$text-muted"), (shown, "$text"))

    @staticmethod
    def _engine_info(view: PanelView) -> Content:
        info = view.info
        if view.engine_state == "starting":
            phase = view.engine_phase or "loading the model"
            return Content.assemble((f"engine starting: {phase}… {view.starting_s:.0f} s", "$text-muted"))
        if info is None:
            return Content("")
        sampling = [("\nsampling ", "$text-muted"), (view.sampling, "")] if view.sampling else []
        step = f" · {info.cpu_step} step" if info.cpu_step else ""
        where = (f"\n{info.endpoint} · measured at client" if info.endpoint else
                 f"\n{info.device} · {info.dtype} · {info.attention_backend}{step} · ctx {info.max_context}")
        ready = [(f"\nready in {view.ready_s:.1f} s", "$text-muted")] if view.ready_s is not None else []
        return Content.assemble((f"{info.model_name}", "bold"), (where, "$text-muted"), *ready, *sampling)
