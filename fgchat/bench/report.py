"""Text report (serving-benchmark style blocks + one summary table), JSON and CSV output."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, TextIO

from fgchat.metrics.csv_export import atomic_write_text
from fgchat.metrics.stats import host_bound


def _f(v: float | None, nd: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{nd}f}"


def _block(run: dict[str, Any], captures: list[dict[str, Any]]) -> str:
    w = 50
    lines = [f" {run['runner']} | batch {run['batch_size']} ".center(w, "=")]
    lines.append(f"{'Requests:':<36}{run['requests']:>14}")
    lines.append(f"{'Output token throughput (tok/s):':<36}{_f(run['output_tokens_per_s'], 1):>14}")
    for title, key, label in (("Time to First Token", "ttft_ms", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
                              ("Inter-token Latency", "itl_ms", "ITL")):
        lines.append(f" {title} ".center(w, "-"))
        s = run[key]
        lines.append(f"{'Mean ' + label + ' (ms):':<36}{_f(s['mean'], 3):>14}")
        lines.append(f"{'Median ' + label + ' (ms):':<36}{_f(s['median'], 3):>14}")
        lines.append(f"{'P99 ' + label + ' (ms):':<36}{_f(s['p99'], 3):>14}")
    if run.get("speculate", "off") != "off":
        lines.append(f" Speculation ({run['speculate']}) ".center(w, "-"))
        rate = run.get("acceptance_rate")
        lines.append(f"{'Acceptance rate (%):':<36}{_f(None if rate is None else 100 * rate, 1):>14}")
        lines.append(f"{'Tokens per step:':<36}{_f(run.get('tokens_per_step'), 2):>14}")
        oracle = run.get("oracle")
        if oracle:
            settled = f"{oracle['rounds']}{'' if oracle['reproduced'] else ' (unsettled)'}"
            lines.append(f"{'Oracle rounds to settle drafts:':<36}{settled:>14}")
    lines.append(" Step ".center(w, "-"))
    lines.append(f"{'GPU time per step (ms):':<36}{_f(run['gpu_step_ms']['mean'], 3):>14}")
    lines.append(f"{'Host overhead per step (ms):':<36}{_f(run.get('host_overhead_ms'), 3):>14}")
    launch = (run.get("launch_ms") or {}).get("mean")
    lines.append(f"{'Host launch per step (ms):':<36}{_f(launch, 3):>14}")
    if run.get("bandwidth_share") is not None:
        lines.append(f"{'Weight bytes read per step (MB):':<36}{_f(run['step_bytes'] / 1e6, 1):>14}")
        lines.append(f"{'Share of peak memory bandwidth (%):':<36}{_f(100 * run['bandwidth_share'], 1):>14}")
    if run.get("captures_timed") is not None:
        lines.append(f"{'Graph captures in timed rounds:':<36}{run['captures_timed']:>14}")
    caps = [c for c in captures if c["mode"] == run["mode"] and c["batch_size"] == run["batch_size"]
            and c.get("kind", "decode") == "decode"
            and c.get("weights_label", "") == run.get("weights_label", "")]
    if caps:
        lines.append(f"{'Graph capture (s):':<36}{_f(sum(c['seconds'] for c in caps), 3):>14}")
        lines.append(f"{'Graph pool (MiB):':<36}{_f(sum(c['pool_mib'] for c in caps), 1):>14}")
    return "\n".join(lines)


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (runner, batch) with ratios: TPOT of the reference / TPOT of this runner."""
    runs = result["runs"]
    by = {(r["runner"], r["batch_size"]): r for r in runs}
    rows = []
    for r in runs:
        tpot = r["tpot_ms"]["mean"]
        label = r.get("weights_label", "")
        row = {"runner": r["runner"], "batch_size": r["batch_size"], "ttft_ms_median": r["ttft_ms"]["median"],
               "tpot_ms_mean": tpot, "itl_ms_p99": r["itl_ms"]["p99"],
               "output_tokens_per_s": r["output_tokens_per_s"], "gpu_step_ms_mean": r["gpu_step_ms"]["mean"],
               "launch_ms_mean": (r.get("launch_ms") or {}).get("mean"),
               "weights": r.get("weights"), "bandwidth_share": r.get("bandwidth_share"),
               "acceptance_rate": r.get("acceptance_rate"), "tokens_per_step": r.get("tokens_per_step")}
        for ref in ("fgchat-eager", "fgchat-piecewise", "hf-eager", "hf-compile"):
            # our modes against the same weight set's; the peers run the model's own weights
            name = f"{ref}-{label}" if label and ref.startswith("fgchat-") else ref
            other = by.get((name, r["batch_size"]))
            ot = other["tpot_ms"]["mean"] if other else None
            row[f"speedup_vs_{ref}"] = (ot / tpot) if (ot and tpot) else None
        method = r.get("speculate", "off")
        plain = by.get((r["runner"].replace(f"+{method}", "", 1), r["batch_size"])) if method != "off" else None
        # a speculated row's tokens/s over its plain row's (same mode, weights and batch)
        row["speedup_vs_plain"] = (r["output_tokens_per_s"] / plain["output_tokens_per_s"]
                                   if plain and plain["output_tokens_per_s"] else None)
        rows.append(row)
    return rows


def print_report(result: dict[str, Any], out: TextIO) -> None:
    m = result["meta"]
    out.write(f"fgchat bench | {m['model']} | {m['device']} | {m['dtype']} | attention {m['attention']} | "
              f"{prompt_header(m)} | output {m['output_len']} | commit {m['commit']}\n")
    if m.get("host_cpu"):
        out.write(f"host CPU (eager and piecewise launch times follow it): {m['host_cpu']}\n")
    if m.get("cpu_step"):
        out.write(f"CPU decode step: {m['cpu_step']}\n")
    for line in weight_lines(m):
        out.write(line + "\n")
    out.write("\n")
    for run in result["runs"]:
        out.write(_block(run, result["captures"]) + "\n\n")
    oracle = next((r["oracle"] for r in result["runs"] if r.get("oracle")), None)
    if oracle:
        out.write(f"oracle drafts: {oracle['drafts_from']}\n")
    if result["captures"]:
        tot = sum(c["seconds"] for c in result["captures"])
        mib = sum(c["pool_mib"] for c in result["captures"])
        out.write(f"graph capture total: {tot:.2f} s, pools {mib:.1f} MiB\n")
        pre = [c for c in result["captures"] if c.get("kind") == "prefill"]
        if pre:
            out.write(f"  of which prefill graphs ({len(pre)} token buckets up to {max(c['batch_size'] for c in pre)}): "
                      f"{sum(c['seconds'] for c in pre):.2f} s, {sum(c['pool_mib'] for c in pre):.1f} MiB\n")
    warm = result["meta"].get("kernel_warmup_s")
    if warm is not None:
        out.write(f"kernel warm-up before capture (Triton JIT on a cold cache): {warm:.2f} s\n")
    sc = result["meta"].get("startup_check")
    if sc:
        verdict = "passed" if sc["passed"] else f"FAILED ({sc['message']})"
        out.write(f"startup check vs float32 reference ({sc['path']}): {verdict}, max rel err "
                  f"{sc['max_rel_err']:.3f}, top-5 overlap {sc['top5_overlap']}/5, {sc['seconds']:.2f} s\n")
    for s in result["skipped"]:
        out.write(f"skipped {s['runner']}: {s['reason']}\n")
    if m.get("interrupted"):
        out.write("interrupted (Ctrl-C): only the runs that finished before it are reported\n")
    from rich.console import Console

    rows = summary_rows(result)
    Console(file=out, width=_width(out)).print(summary_table(rows))
    for r in rows:
        if host_bound(r["launch_ms_mean"], r["gpu_step_ms_mean"]):
            out.write(f"host-bound: {r['runner']} batch {r['batch_size']} takes {r['launch_ms_mean']:.3f} ms "
                      f"to launch a step the GPU runs in {r['gpu_step_ms_mean']:.3f} ms; its TPOT follows "
                      f"the host CPU\n")


def prompt_header(meta: dict[str, Any]) -> str:
    """The header's prompt field: "prompt 512" (random prompts of that many tokens) or a set's name,
    its prompts and their token counts ("prompts grounded: 8, 181..402 tokens"; replies stop at EOS)."""
    counts = meta.get("prompt_tokens")
    if not counts:
        return f"prompt {meta['prompt_len']}"
    return (f"prompts {meta.get('prompts')}: {len(counts)}, {min(counts)}..{max(counts)} tokens, "
            f"stop at end of sequence")


def weight_lines(meta: dict[str, Any]) -> list[str]:
    """One line per weight set: format, bytes held and read per step; the GPU's peak bandwidth."""
    peak = meta.get("peak_bandwidth")
    lines = []
    for ws in meta.get("weight_sets") or []:
        asked = f" (--quantize {ws['quantize']})" if ws.get("quantize", "none") != "none" else ""
        lines.append(f"weights {ws['weights']}{asked}: {ws['weight_bytes'] / 1e6:.1f} MB, "
                     f"a decode step reads {ws['step_bytes'] / 1e6:.1f} MB")
    if lines:
        lines.append(f"peak memory bandwidth: {peak / 1e12:.2f} TB/s" if peak else
                     "peak memory bandwidth: unknown (no share of it shown)")
    return lines


SUMMARY_COLUMNS: list[tuple[str, str, int | None]] = [  # (header, summary key, decimals; None: ratio)
    ("runner", "runner", -1), ("weights", "weights", -1), ("batch", "batch_size", -1),
    ("TTFT p50 ms", "ttft_ms_median", 2),
    ("TPOT ms", "tpot_ms_mean", 3), ("ITL p99 ms", "itl_ms_p99", 3), ("tok/s", "output_tokens_per_s", 0),
    ("GPU ms/step", "gpu_step_ms_mean", 3), ("launch ms/step", "launch_ms_mean", 3),
    ("BW %", "bandwidth_share", -2), ("accept %", "acceptance_rate", -2), ("tok/step", "tokens_per_step", 2),
    ("× eager", "speedup_vs_fgchat-eager", None), ("× piecewise", "speedup_vs_fgchat-piecewise", None),
    ("× plain", "speedup_vs_plain", None), ("× hf-eager", "speedup_vs_hf-eager", None), ("× hf-compile", "speedup_vs_hf-compile", None),
]


def summary_table(rows: list[dict[str, Any]]) -> Any:
    """The summary as a rich Table, without columns that are empty in every row (no GPU timing on
    CPU, peers not run). "× other" = the other runner's TPOT / this row's: above 1, this row is faster."""
    from rich.table import Table

    def cell(r: dict[str, Any], key: str, digits: int | None) -> str:
        v = r.get(key)
        if v is None:
            return ""
        if digits is None:
            return f"{v:.2f}x"
        if digits == -2:
            return f"{100 * v:.0f}%"
        return str(v) if digits < 0 else _f(v, digits)

    # the weights column only where they vary (a peer's row has none: the model's own)
    varies = len({r["weights"] for r in rows if r.get("weights")}) > 1
    cols = [c for c in SUMMARY_COLUMNS if any(r.get(c[1]) is not None for r in rows)
            and (c[1] != "weights" or varies)]
    t = Table(title="summary (× other = other's TPOT / this TPOT: > 1 means this row is faster)",
              title_justify="left")
    for header, _, _ in cols:
        t.add_column(header, justify="right", overflow="fold")
    for r in rows:
        t.add_row(*(cell(r, key, d) for _, key, d in cols))
    return t


def _width(out: TextIO) -> int:
    """The terminal's width when writing to one, else wide enough for every column (files, pipes)."""
    import shutil

    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        return shutil.get_terminal_size((120, 24)).columns
    return 160


def write_json(result: dict[str, Any], path: Path) -> None:
    atomic_write_text(path, json.dumps({**result, "summary": summary_rows(result)}, indent=1))


def write_csv(result: dict[str, Any], path: Path) -> None:
    """The summary rows; each says whether the run was interrupted (Ctrl-C: only the finished
    runs are there), as the JSON's meta.interrupted does."""
    stopped = "true" if result["meta"].get("interrupted") else "false"
    rows = [{**row, "interrupted": stopped} for row in summary_rows(result)]
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    atomic_write_text(path, buf.getvalue())

