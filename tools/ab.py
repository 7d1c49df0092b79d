"""A/B runner: one command run under two or more settings, one fresh process per run, the settings
alternating run by run and the order rotating round by round, so drift of the machine over the
session falls on every side alike. A side is a label and environment assignments (`new:` for
none, `old:PYTHONPATH=.old` for another tree, `unfused:FGCHAT_FUSED=0` for a switch). For
`fgchat bench` commands the runner adds `--json` and compares each (runner, batch) row's
--field (default TPOT); for any other command --metric is a regular expression whose first group
is the number, taken from the last matching line of stdout. Prints each side's median over the
rounds and the median paired ratio to the first side (within a round, both ran back to back).

    python tools/ab.py --side old:PYTHONPATH=.old --side new: --rounds 4 -- \\
        python -P -m fgchat.cli bench --preset llama-3.2-1b --random-weights --batch-sizes 1,8
    python tools/ab.py --side fused: --side plain:FGCHAT_FUSED=0 --metric 'ttft_ms ([0-9.]+)' -- CMD...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

Side = tuple[str, dict[str, str]]


def parse_side(text: str) -> Side:
    """"LABEL:VAR=VALUE[,VAR=VALUE...]" -> (label, env); an empty list after the colon sets nothing."""
    label, sep, assigns = text.partition(":")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"side {text!r}: expected LABEL:[VAR=VALUE,...]")
    env = {}
    for item in filter(None, assigns.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise argparse.ArgumentTypeError(f"side {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return label, env


def order(sides: list[Side], rnd: int) -> list[Side]:
    """The sides of round `rnd`, rotated so each side goes first in turn."""
    k = rnd % len(sides)
    return sides[k:] + sides[:k]


def is_bench(cmd: list[str]) -> bool:
    return "bench" in cmd and any("fgchat" in c for c in cmd)


def bench_values(path: Path, field: str) -> dict[str, float]:
    """{"runner bN": value} of one `fgchat bench --json` file's summary rows."""
    rows = json.loads(path.read_text())["summary"]
    return {f"{r['runner']} b{r['batch_size']}": float(r[field]) for r in rows if r.get(field) is not None}


def metric_value(stdout: str, pattern: re.Pattern[str]) -> dict[str, float]:
    found = [m for m in map(pattern.search, stdout.splitlines()) if m]
    if not found:
        raise ValueError(f"no line of the output matches --metric {pattern.pattern!r}")
    return {"metric": float(found[-1].group(1))}


def run_once(cmd: list[str], env: dict[str, str], json_path: Path | None, pattern: re.Pattern[str] | None,
             field: str) -> dict[str, float]:
    full = [*cmd, "--json", str(json_path)] if json_path else cmd
    proc = subprocess.run(full, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"exit {proc.returncode}: {tail[0]}")
    return bench_values(json_path, field) if json_path else metric_value(proc.stdout, pattern)


def summarize(sides: list[Side], runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """Per key: each side's median and its median paired ratio to the first side."""
    base = sides[0][0]
    lines = []
    for key in runs[base][0]:
        cells = []
        for label, _ in sides:
            xs = [r[key] for r in runs[label] if key in r]
            cell = f"{label} {statistics.median(xs):.4g}"
            if label != base:
                pairs = [a[key] / b[key] for a, b in zip(runs[label], runs[base]) if key in a and b.get(key)]
                cell += f" ({statistics.median(pairs):.3f}x)" if pairs else ""
            cells.append(cell)
        lines.append(f"{key:28} " + " | ".join(cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--side", action="append", type=parse_side, required=True,
                    help="LABEL:[VAR=VALUE,...], given twice or more; the first is the ratios' base")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each side (default %(default)s)")
    ap.add_argument("--metric", help="regex with one group: the number a non-bench command prints")
    ap.add_argument("--field", default="tpot_ms_mean",
                    help="bench summary field compared (default %(default)s; e.g. output_tokens_per_s)")
    ap.add_argument("--keep", type=Path, help="folder to keep each bench run's JSON in")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command after --")
    if len(a.side) < 2 or len({label for label, _ in a.side}) != len(a.side):
        ap.error("--side: at least two, each label once")
    bench = is_bench(cmd)
    if not bench and not a.metric:
        ap.error("--metric is needed for a command other than fgchat bench")
    pattern = re.compile(a.metric) if a.metric else None
    if pattern is not None and pattern.groups < 1:
        ap.error("--metric needs one (group) around the number")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    keep = a.keep or Path(tempfile.mkdtemp(prefix="fgchat-ab-"))
    keep.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in a.side}
    for rnd in range(a.rounds):
        for label, env in order(a.side, rnd):
            json_path = keep / f"{label}-{rnd}.json" if bench and pattern is None else None
            try:
                values = run_once(cmd, env, json_path, pattern, a.field)
            except (RuntimeError, ValueError, KeyError, OSError) as exc:
                sys.exit(f"ab: side {label}, round {rnd}: {exc}")
            runs[label].append(values)
            print(f"round {rnd} {label}: " + " ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)
    print(f"medians over {a.rounds} rounds ({a.field if bench and pattern is None else 'metric'}; "
          f"ratio to {a.side[0][0]}, paired by round):")
    print("\n".join(summarize(a.side, runs)))


if __name__ == "__main__":
    main()
