"""An SVG bar chart of `fgchat bench` results: milliseconds per decode step (TPOT mean) by batch
size, one bar per runner in each batch-size group, one panel per model.

The SVG is built as plain text (no plotting library) and is deterministic: the same results give
the same bytes. It draws on its own white background so that it reads the same in light and dark
page themes.

Several results may feed one panel (e.g. two processes of the same call, or a modes run and a
peers run of one model). A (runner, batch size) measured in more than one of them is drawn as the
mean of their TPOT means with a whisker over their range, and the caption says so; the caption
also names every commit, device and dtype the panel's results carry, so results of different
commits are never shown as one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from fgchat.protocol.errors import FgchatError

# Runners in this order first (fastest fgchat mode first), then any other in order of appearance.
KNOWN_RUNNERS = ("fgchat-full", "fgchat-piecewise", "fgchat-eager", "hf-compile", "hf-eager", "endpoint")
RUNNER_COLORS = {
    "fgchat-full": "#2563eb", "fgchat-piecewise": "#0d9488", "fgchat-eager": "#d97706",
    "hf-compile": "#9333ea", "hf-eager": "#dc2626", "endpoint": "#475569",
}
OTHER_COLORS = ("#db2777", "#65a30d", "#0891b2", "#7c3aed", "#b45309", "#64748b")

WIDTH_MIN = 760
MARGIN_X = 24
AXIS_W = 64  # room left of the plot for the y tick labels and the axis title
PLOT_H = 240
BAR_MIN_W = 18
BAR_MAX_W = 56
GROUP_GAP = 28
FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
CHAR_W = 6.4  # estimated width of one character at font-size 11 (text is never measured)
TEXT = "#111827"
MUTED = "#4b5563"
GRID = "#e5e7eb"


@dataclass
class _Bar:
    values: list[float] = field(default_factory=list)  # one TPOT mean per result that measured it

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)


@dataclass
class _Panel:
    title: str
    results: list[dict[str, Any]] = field(default_factory=list)
    bars: dict[tuple[str, int], _Bar] = field(default_factory=dict)
    runners: list[str] = field(default_factory=list)  # every runner with a run here, measured or not
    batches: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------- input
def check_result(result: Any, where: str) -> None:
    """Raise a one-line FgchatError unless `result` has the shape `fgchat bench --json` writes:
    a non-empty "runs" list of runs with a runner name, a batch size >= 1 and a tpot_ms mean that
    is a finite number >= 0 or null (nothing measured)."""
    if not isinstance(result, dict):
        raise FgchatError(f"{where}: not an `fgchat bench --json` result (expected a JSON object)")
    runs = result.get("runs")
    if not isinstance(runs, list) or not runs:
        raise FgchatError(f"{where}: no runs (not an `fgchat bench --json` result, or every runner was skipped)")
    if not isinstance(result.get("meta", {}), dict):
        raise FgchatError(f"{where}: \"meta\" is not an object")
    for i, run in enumerate(runs, 1):
        if not isinstance(run, dict):
            raise FgchatError(f"{where}: run {i} is not an object")
        if not isinstance(run.get("runner"), str) or not run["runner"]:
            raise FgchatError(f"{where}: run {i} has no runner name")
        batch = run.get("batch_size")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise FgchatError(f"{where}: run {i} ({run['runner']}) has no batch size >= 1")
        tpot = run.get("tpot_ms")
        mean = tpot.get("mean") if isinstance(tpot, dict) else None
        if not isinstance(tpot, dict) or "mean" not in tpot:
            raise FgchatError(f"{where}: run {i} ({run['runner']}, batch {batch}) has no tpot_ms mean")
        if mean is not None and (isinstance(mean, bool) or not isinstance(mean, (int, float))
                                 or not math.isfinite(mean) or mean < 0):
            raise FgchatError(f"{where}: run {i} ({run['runner']}, batch {batch}) has tpot_ms mean {mean!r}, "
                              "not a number >= 0")


def load_results(paths: list[str]) -> list[dict[str, Any]]:
    """Read and check `fgchat bench --json` files; any problem is a one-line FgchatError naming the file."""
    results = []
    for path in paths:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise FgchatError(f"cannot read --from-json {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise FgchatError(f"--from-json {path}: not UTF-8 text") from None
        try:
            result = json.loads(text)
        except ValueError as e:
            raise FgchatError(f"--from-json {path}: not JSON ({e})") from None
        check_result(result, f"--from-json {path}")
        results.append(result)
    return results


# ---------------------------------------------------------------------------- grouping
def _panel_key(meta: dict[str, Any]) -> tuple[str, str, bool]:
    return str(meta.get("model") or "unknown model"), str(meta.get("device") or ""), bool(meta.get("penalties"))


def _panels(results: list[dict[str, Any]]) -> list[_Panel]:
    """Results grouped by (model, device, penalties on), in order of first appearance; the device
    is in a panel's title only when the results come from more than one."""
    panels: dict[tuple[str, str, bool], _Panel] = {}
    devices = {_panel_key(r.get("meta") or {})[1] for r in results}
    for result in results:
        meta = result.get("meta") or {}
        key = _panel_key(meta)
        if key not in panels:
            model, device, penalties = key
            panels[key] = _Panel(model + (f" · {device}" if len(devices) > 1 and device else "")
                                 + (" · penalties on" if penalties else ""))
        panel = panels[key]
        panel.results.append(result)
        for run in result["runs"]:
            runner, batch, mean = run["runner"], run["batch_size"], run["tpot_ms"]["mean"]
            if runner not in panel.runners:
                panel.runners.append(runner)
            if batch not in panel.batches:
                panel.batches.append(batch)
            if mean is not None:
                panel.bars.setdefault((runner, batch), _Bar()).values.append(float(mean))
    for panel in panels.values():
        panel.batches.sort()
    return list(panels.values())


def _runner_order(panels: list[_Panel]) -> list[str]:
    seen: list[str] = []
    for panel in panels:
        seen += [r for r in panel.runners if r not in seen]
    return [r for r in KNOWN_RUNNERS if r in seen] + [r for r in seen if r not in KNOWN_RUNNERS]


def _colors(runners: list[str]) -> dict[str, str]:
    others = [r for r in runners if r not in RUNNER_COLORS]
    out = {r: RUNNER_COLORS[r] for r in runners if r in RUNNER_COLORS}
    out.update({r: OTHER_COLORS[i % len(OTHER_COLORS)] for i, r in enumerate(others)})
    return out


# ---------------------------------------------------------------------------- drawing helpers
def _attr(value: str) -> str:
    return escape(value, {'"': "&quot;"})


def _n(x: float) -> str:
    """A coordinate with one decimal, without a trailing ".0" (stable text for the same input)."""
    s = f"{x:.1f}"
    return s[:-2] if s.endswith(".0") else s


def _text(x: float, y: float, s: str, size: int = 11, fill: str = TEXT, anchor: str = "start",
          weight: str | None = None, extra: str = "") -> str:
    bold = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{_n(x)}" y="{_n(y)}" font-size="{size}" fill="{fill}" text-anchor="{anchor}"{bold}'
            f'{extra}>{escape(s)}</text>')


def format_ms(v: float) -> str:
    """A bar's label: three decimals below 10 ms, two below 100, one above."""
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) that splits `span` into about `ticks` parts."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * power >= raw - 1e-12:
            return m * power
    return 10 * power


def _tick_label(v: float, step: float) -> str:
    """`v` with as many decimals as the tick step has (0.25 -> two, 0.5 -> one, 5 -> none)."""
    exponent = math.floor(math.log10(step) + 1e-9)
    decimals = max(0, -exponent) + (1 if round(step / 10 ** exponent, 6) == 2.5 else 0)
    return f"{v:.{decimals}f}"


def _caption_lines(panel: _Panel) -> list[str]:
    def distinct(key: str) -> list[str]:
        out: list[str] = []
        for r in panel.results:
            v = (r.get("meta") or {}).get(key)
            if v is not None and str(v) not in out:
                out.append(str(v))
        return out

    commits, devices, dtypes = distinct("commit"), distinct("device"), distinct("dtype")
    first = []
    if devices:
        first.append(", ".join(devices))
    if dtypes:
        first.append(", ".join(dtypes))
    if len(commits) == 1:
        first.append(f"commit {commits[0]}")
    elif commits:
        first.append(f"results of {len(commits)} different commits: {', '.join(commits)}")
    prompt, output = distinct("prompt_len"), distinct("output_len")
    sets = [s for s in distinct("prompts") if s != "random"]  # a --prompts set: no prompt_len
    if len(prompt) == 1 and len(output) == 1:
        first.append(f"prompt {prompt[0]}, output {output[0]} tokens")
    elif not prompt and len(sets) == 1 and len(output) == 1:
        first.append(f"prompts {sets[0]}, output up to {output[0]} tokens")
    second = []
    for r in panel.results:
        pen = (r.get("meta") or {}).get("penalties")
        text = "penalties " + ", ".join(f"{k} {v}" for k, v in pen.items()) if isinstance(pen, dict) else None
        if text and text not in second:
            second.append(text)
    hosts = distinct("host_cpu")
    if hosts:
        second.append("host CPU " + ", ".join(hosts))
    if any((r.get("meta") or {}).get("interrupted") for r in panel.results):
        second.append("interrupted (Ctrl-C): only the runs that finished")
    n = len(panel.results)
    if any(len(b.values) > 1 for b in panel.bars.values()):
        second.append(f"{n} results: a bar measured in several is their mean, its whisker their range")
    elif n > 1:
        second.append(f"{n} results")
    return [" · ".join(first), " · ".join(second)] if second else [" · ".join(first)]


# ---------------------------------------------------------------------------- chart
def bar_chart_svg(results: list[dict[str, Any]], title: str | None = None) -> str:
    """Grouped bars of TPOT mean (ms per decode step): x groups = batch sizes, one bar per runner,
    one panel per model (and per penalties setting), stacked top to bottom. Raises FgchatError for
    input without runs or without a single TPOT value."""
    if not results:
        raise FgchatError("no bench results to chart")
    for i, result in enumerate(results, 1):
        check_result(result, f"result {i}")
    panels = _panels(results)
    if not any(p.bars for p in panels):
        raise FgchatError("no run has a TPOT mean (every run measured nothing)")
    runners = _runner_order(panels)
    colors = _colors(runners)
    title = title or "fgchat bench: milliseconds per decode step (TPOT mean, lower is faster)"

    most_bars = max(len(p.runners) for p in panels)
    most_groups = max(len(p.batches) for p in panels)
    plot_w_min = WIDTH_MIN - 2 * MARGIN_X - AXIS_W
    bar_w = min(BAR_MAX_W, max(BAR_MIN_W, (plot_w_min / most_groups - GROUP_GAP) / most_bars))
    # wide enough for the bars and for the longest line of text (text is never wrapped)
    text_w = max([len(title) * CHAR_W * 16 / 11 - AXIS_W]
                 + [len(p.title) * CHAR_W * 14 / 11 for p in panels]
                 + [len(line) * CHAR_W for p in panels for line in _caption_lines(p)])
    plot_w = max(plot_w_min, most_groups * (most_bars * bar_w + GROUP_GAP), text_w)
    width = plot_w + 2 * MARGIN_X + AXIS_W
    x0 = MARGIN_X + AXIS_W

    body: list[str] = []
    y = 34.0
    body.append(_text(width / 2, y, title, size=16, anchor="middle", weight="600"))
    y += 24
    # legend: swatch + name, wrapped to the chart's width
    lx, items = MARGIN_X, []
    for r in runners:
        w = 14 + 6 + len(r) * CHAR_W + 18
        if lx + w > width - MARGIN_X and lx > MARGIN_X:
            lx, y = MARGIN_X, y + 20
        items.append(f'<rect x="{_n(lx)}" y="{_n(y - 10)}" width="14" height="12" rx="2" fill="{colors[r]}"/>')
        items.append(_text(lx + 20, y, r, size=12))
        lx += w
    body.append('<g class="legend">' + "".join(items) + "</g>")
    y += 18

    for panel in panels:
        body.append(_panel_svg(panel, colors, x0, y, plot_w, bar_w))
        y += _panel_height(panel)
    height = y + 8
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(width)}" height="{_n(height)}" '
            f'viewBox="0 0 {_n(width)} {_n(height)}" font-family="{_attr(FONT)}" role="img">'
            f"<title>{escape(title)}</title>"
            f'<rect x="0" y="0" width="{_n(width)}" height="{_n(height)}" rx="8" fill="#ffffff"/>')
    return head + "\n" + "\n".join(body) + "\n</svg>\n"


def _label_room(panel: _Panel, bar_w: float) -> tuple[float, bool]:
    """Height kept above the tallest bar for its label, and whether labels stand vertically
    (when the widest label is wider than a bar and its gap)."""
    widest = max((len(format_ms(b.mean)) for b in panel.bars.values()), default=4) * CHAR_W * 10 / 11
    if widest <= bar_w + 2:
        return 16.0, False
    return widest + 8, True


def _panel_height(panel: _Panel) -> float:
    return 26 + PLOT_H + 40 + 16 * len(_caption_lines(panel)) + 18


def _panel_svg(panel: _Panel, colors: dict[str, str], x0: float, top: float, plot_w: float,
               bar_w: float) -> str:
    out: list[str] = [f'<g class="panel" data-model="{_attr(panel.title)}">']
    out.append(_text(x0, top + 14, panel.title, size=14, weight="600"))
    py = top + 26  # top of the plot area
    base = py + PLOT_H  # y of 0 ms
    room, vertical = _label_room(panel, bar_w)
    top_value = max((max(b.values) for b in panel.bars.values()), default=1.0) or 1.0
    need = top_value * PLOT_H / (PLOT_H - room)  # axis top that leaves `room` above the tallest bar
    step = nice_step(need)
    axis_max = step * math.ceil(need / step - 1e-9)
    scale = PLOT_H / axis_max  # px per ms; every bar's height is value * scale

    k = 0
    while k * step <= axis_max + 1e-9:
        ty = base - k * step * scale
        out.append(f'<line x1="{_n(x0)}" y1="{_n(ty)}" x2="{_n(x0 + plot_w)}" y2="{_n(ty)}" '
                   f'stroke="{GRID if k else MUTED}" stroke-width="1"/>')
        out.append(_text(x0 - 6, ty + 4, _tick_label(k * step, step), size=11, fill=MUTED, anchor="end"))
        k += 1
    ay = py + PLOT_H / 2
    out.append(_text(x0 - 46, ay, "ms per decode step", size=11, fill=MUTED, anchor="middle",
                     extra=f' transform="rotate(-90 {_n(x0 - 46)} {_n(ay)})"'))

    group_w = plot_w / len(panel.batches)
    runners = _runner_order([panel])
    for g, batch in enumerate(panel.batches):
        gx = x0 + g * group_w + (group_w - len(panel.runners) * bar_w) / 2
        out.append(_text(x0 + (g + 0.5) * group_w, base + 18, f"batch {batch}", size=12, anchor="middle"))
        for i, runner in enumerate(runners):
            bx = gx + i * bar_w
            cx = bx + bar_w / 2
            bar = panel.bars.get((runner, batch))
            if bar is None:
                out.append(_text(cx, base - 4, "n/a", size=10, fill=MUTED, anchor="middle"))
                continue
            h = bar.mean * scale
            out.append(f'<rect class="bar" x="{_n(bx + 1)}" y="{_n(base - h)}" width="{_n(bar_w - 2)}" '
                       f'height="{_n(h)}" fill="{colors[runner]}" data-runner="{_attr(runner)}" '
                       f'data-batch="{batch}" data-ms="{bar.mean:.6g}">'
                       f"<title>{escape(f'{runner}, batch {batch}: {format_ms(bar.mean)} ms')}</title></rect>")
            label_y = base - h - 5
            if len(bar.values) > 1:
                lo, hi = min(bar.values) * scale, max(bar.values) * scale
                out.append(f'<path d="M{_n(cx)} {_n(base - lo)}V{_n(base - hi)}M{_n(cx - 4)} {_n(base - hi)}'
                           f'H{_n(cx + 4)}M{_n(cx - 4)} {_n(base - lo)}H{_n(cx + 4)}" stroke="{TEXT}" '
                           'stroke-width="1.2" fill="none"/>')
                label_y = min(label_y, base - hi - 5)
            label = format_ms(bar.mean)
            if vertical:
                out.append(_text(cx + 4, label_y, label, size=10, extra=f' class="value" transform="rotate(-90 '
                                 f'{_n(cx + 4)} {_n(label_y)})"'))
            else:
                out.append(_text(cx, label_y, label, size=10, anchor="middle", extra=' class="value"'))
    out.append(_text(x0 + plot_w / 2, base + 34, "batch size (concurrent sequences)", size=11, fill=MUTED,
                     anchor="middle"))
    cy = base + 40
    for line in _caption_lines(panel):
        cy += 16
        out.append(_text(x0, cy, line, size=11, fill=MUTED, extra=' class="caption"'))
    out.append("</g>")
    return "\n".join(out)
