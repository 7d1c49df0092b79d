"""The bench chart: SVG bars of ms per decode step by batch size and runner, from bench results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fgchat.bench.chart import bar_chart_svg, format_ms, load_results
from fgchat.cli import main
from fgchat.protocol.errors import FgchatError

SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(__file__).resolve().parents[2]
README_CHART = ROOT / "tests" / "bench" / "data" / "chart-6d653ea.svg"
README_CHART_SOURCES = [ROOT / "tests" / "bench" / "data" / f"bench-{name}-6d653ea.json"
                        for name in ("1b", "135m", "embedded")]


def result(runs: dict[tuple[str, int], float | None], model: str = "llama-3.2-1b (random weights)",
           commit: str = "abc1234", device: str = "NVIDIA H200", penalties: dict | None = None) -> dict:
    """A result in the shape `fgchat bench --json` writes, reduced to what the chart reads."""
    return {
        "meta": {"model": model, "device": device, "dtype": "bfloat16", "commit": commit, "prompt_len": 512,
                 "output_len": 128, "host_cpu": "Test CPU", "penalties": penalties},
        "captures": [], "skipped": [],
        "runs": [{"runner": runner, "mode": runner.split("-", 1)[-1], "batch_size": batch,
                  "tpot_ms": {"mean": ms, "median": ms, "p90": ms, "p99": ms}}
                 for (runner, batch), ms in runs.items()],
    }


GRID = {("fgchat-eager", 1): 2.5, ("fgchat-eager", 8): 3.1, ("fgchat-piecewise", 1): 1.02,
        ("fgchat-piecewise", 8): 1.1, ("fgchat-full", 1): 0.917, ("fgchat-full", 8): 1.021}


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # raises on anything not well-formed


def bars(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]


def texts(root: ET.Element, cls: str | None = None) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text") if cls is None or t.get("class") == cls]


def test_one_bar_per_runner_and_batch_size():
    root = parse(bar_chart_svg([result(GRID)]))
    assert root.tag == f"{SVG}svg"
    found = {(b.get("data-runner"), int(b.get("data-batch"))) for b in bars(root)}
    assert len(bars(root)) == 3 * 2
    assert found == set(GRID)
    legend = "".join(next(g for g in root.iter(f"{SVG}g") if g.get("class") == "legend").itertext())
    assert legend.index("fgchat-full") < legend.index("fgchat-piecewise") < legend.index("fgchat-eager")


def test_bar_heights_are_proportional_to_the_milliseconds():
    root = parse(bar_chart_svg([result(GRID)]))
    by = {(b.get("data-runner"), int(b.get("data-batch"))): b for b in bars(root)}
    px_per_ms = {key: float(by[key].get("height")) / ms for key, ms in GRID.items()}
    first = next(iter(px_per_ms.values()))
    assert all(abs(v - first) / first < 0.01 for v in px_per_ms.values()), px_per_ms
    # every bar stands on the same baseline, and a larger value is a taller bar
    assert len({round(float(b.get("y")) + float(b.get("height")), 1) for b in bars(root)}) == 1
    ordered = sorted(GRID, key=GRID.get)
    heights = [float(by[k].get("height")) for k in ordered]
    assert heights == sorted(heights) and heights[0] < heights[-1]


def test_labels_carry_the_values():
    runs = {**GRID, ("hf-eager", 1): 17.17, ("hf-eager", 8): 123.45}
    root = parse(bar_chart_svg([result(runs)]))
    labels = texts(root, "value")
    assert sorted(labels) == sorted(["0.917", "1.021", "1.020", "1.100", "2.500", "3.100", "17.17", "123.5"])
    for b in bars(root):
        assert float(b.get("data-ms")) == pytest.approx(runs[(b.get("data-runner"), int(b.get("data-batch")))])


def test_format_ms():
    values = (0.5, 0.9174, 9.9994, 17.166, 123.45)
    assert [format_ms(v) for v in values] == ["0.500", "0.917", "9.999", "17.17", "123.5"]


def test_caption_names_model_device_and_commit():
    root = parse(bar_chart_svg([result(GRID, commit="4671e3c")]))
    caption = " ".join(texts(root, "caption"))
    assert "NVIDIA H200" in caption and "commit 4671e3c" in caption and "bfloat16" in caption
    assert "llama-3.2-1b (random weights)" in texts(root)


def test_one_panel_per_model():
    svg = bar_chart_svg([result(GRID), result({("fgchat-full", 1): 0.5, ("fgchat-full", 8): 0.545},
                                              model="smollm2-135m (random weights)")])
    root = parse(svg)
    panels = [g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"]
    assert [p.get("data-model") for p in panels] == ["llama-3.2-1b (random weights)", "smollm2-135m (random weights)"]
    assert [len(bars(p)) for p in panels] == [6, 2]


def test_penalties_and_devices_get_panels_of_their_own():
    pen = {"repetition": 1.1, "presence": 0.5, "frequency": 0.25}
    root = parse(bar_chart_svg([result(GRID), result(GRID, penalties=pen), result(GRID, device="cpu")]))
    titles = [g.get("data-model") for g in root.iter(f"{SVG}g") if g.get("class") == "panel"]
    assert len(titles) == 3 and len(set(titles)) == 3
    assert any("penalties on" in t for t in titles) and any("cpu" in t for t in titles)
    assert any("repetition 1.1" in c for c in texts(root, "caption"))


def test_several_results_of_one_model_are_averaged_with_their_range():
    other = {k: v * 1.5 for k, v in GRID.items()}
    root = parse(bar_chart_svg([result(GRID), result(other)]))
    assert len(bars(root)) == 6
    by = {(b.get("data-runner"), int(b.get("data-batch"))): b for b in bars(root)}
    assert float(by[("fgchat-full", 1)].get("data-ms")) == pytest.approx(0.917 * 1.25)
    assert len([p for p in root.iter(f"{SVG}path")]) == 6  # one whisker per averaged bar
    assert any("mean" in c and "2 results" in c for c in texts(root, "caption"))


def test_mixed_commits_are_said_in_the_caption():
    root = parse(bar_chart_svg([result(GRID, commit="aaaaaaa"), result(GRID, commit="bbbbbbb")]))
    caption = " ".join(texts(root, "caption"))
    assert "2 different commits" in caption and "aaaaaaa" in caption and "bbbbbbb" in caption


def test_a_missing_measurement_is_marked_not_drawn():
    runs = {**GRID, ("fgchat-eager", 8): None}
    root = parse(bar_chart_svg([result(runs)]))
    assert len(bars(root)) == 5
    assert "n/a" in texts(root)


def test_crowded_labels_stand_upright_and_stay_inside():
    runs = {(r, b): 10.0 + i + b / 10 for i, r in enumerate(
        ("fgchat-full", "fgchat-piecewise", "fgchat-eager", "hf-compile", "hf-eager", "llama.cpp", "vllm"))
        for b in (1, 2, 4, 8)}
    root = parse(bar_chart_svg([result(runs)]))
    assert len(bars(root)) == 28
    values = [t for t in root.iter(f"{SVG}text") if t.get("class") == "value"]
    assert values and all("rotate(-90" in (t.get("transform") or "") for t in values)
    # the tallest bar leaves room for its upright label under the panel's top grid line
    tallest = min(float(b.get("y")) for b in bars(root))
    top_line = min(float(ln.get("y1")) for ln in root.iter(f"{SVG}line"))
    assert tallest - top_line > len("17.80") * 5


def test_text_is_escaped_and_output_is_deterministic():
    runs = dict(reversed(list(GRID.items())))
    a = bar_chart_svg([result(GRID, model='m<1> & "2"')], title="a < b")
    b = bar_chart_svg([result(runs, model='m<1> & "2"')], title="a < b")
    assert a == b
    root = parse(a)
    assert 'm<1> & "2"' in texts(root) and "a < b" in texts(root)


@pytest.mark.parametrize("bad,needle", [
    ({"meta": {}, "runs": []}, "no runs"),
    ({"meta": {}}, "no runs"),
    ([1, 2], "JSON object"),
    ({"runs": [{"runner": "fgchat-full", "batch_size": 1}]}, "no tpot_ms mean"),
    ({"runs": [{"runner": "fgchat-full", "batch_size": 0, "tpot_ms": {"mean": 1.0}}]}, "batch size"),
    ({"runs": [{"runner": "fgchat-full", "batch_size": 1, "tpot_ms": {"mean": float("nan")}}]}, "not a number"),
    ({"runs": [{"runner": "fgchat-full", "batch_size": 1, "tpot_ms": {"mean": None}}]}, "no run has a TPOT"),
])
def test_bad_results_are_one_line_errors(bad, needle):
    with pytest.raises(FgchatError) as exc:
        bar_chart_svg([bad])
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_no_results_at_all():
    with pytest.raises(FgchatError, match="no bench results"):
        bar_chart_svg([])


# ---------------------------------------------------------------------------- the CLI
def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """fgchat's main in this process: its exit status, stdout and stderr (errors here are FgchatError
    lines that main returns as status 2, not argparse exits)."""
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc: int, err: str, needle: str) -> None:
    assert rc == 2, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


def test_cli_from_json_writes_the_chart(tmp_path, capsys):
    paths = []
    for i, model in enumerate(("llama-3.2-1b", "smollm2-135m")):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(result(GRID, model=model)))
        paths.append(str(p))
    out = tmp_path / "chart.svg"
    rc, stdout, err = cli(capsys, ["bench", "--chart", str(out), "--from-json", *paths])
    assert rc == 0, err
    assert str(out) in stdout
    root = parse(out.read_text(encoding="utf-8"))
    assert len(bars(root)) == 12


@pytest.mark.parametrize("content,needle", [
    (None, "No such file"),
    ("not json {", "not JSON"),
    ('{"meta": {"model": "x"}, "runs": []}', "no runs"),
])
def test_cli_bad_json_is_one_line(tmp_path, capsys, content, needle):
    src = tmp_path / "in.json"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "chart.svg"
    rc, _, err = cli(capsys, ["bench", "--chart", str(out), "--from-json", str(src)])
    one_line(rc, err, needle)
    assert str(src) in err
    assert not out.exists()


@pytest.mark.parametrize("extra,needle", [
    ([], "--from-json needs --chart"),
    (["--chart", "CHART", "--json", "J"], "leave out --json"),
    (["--chart", "IN"], "is one of the --from-json files"),
])
def test_cli_from_json_option_checks(tmp_path, capsys, extra, needle):
    src = tmp_path / "in.json"
    src.write_text(json.dumps(result(GRID)))
    names = {"CHART": str(tmp_path / "c.svg"), "J": str(tmp_path / "j.json"), "IN": str(src)}
    rc, _, err = cli(capsys, ["bench", "--from-json", str(src), *[names.get(a, a) for a in extra]])
    one_line(rc, err, needle)


def test_cli_chart_path_is_checked_before_a_run(capsys, tmp_path):
    rc, _, err = cli(capsys, ["bench", "--preset", "tiny", "--random-weights",
                                   "--chart", str(tmp_path / "missing" / "c.svg")])
    one_line(rc, err, "directory")
    rc, _, err = cli(capsys, ["bench", "--preset", "tiny", "--random-weights",
                                   "--chart", str(tmp_path / "x"), "--csv", str(tmp_path / "x")])
    one_line(rc, err, "--csv and --chart name the same file")


def test_cli_missing_file_in_a_subprocess_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fgchat.cli", "bench", "--chart", str(tmp_path / "c.svg"),
                        "--from-json", str(tmp_path / "absent.json")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    one_line(p.returncode, p.stderr, "cannot read --from-json")


def test_cli_chart_after_a_run(tmp_path):
    out, js = tmp_path / "run.svg", tmp_path / "run.json"
    p = subprocess.run([sys.executable, "-m", "fgchat.cli", "bench", "--preset", "tiny", "--random-weights",
                        "--device", "cpu", "--modes", "eager", "--batch-sizes", "1,2", "--prompt-len", "8",
                        "--output-len", "4", "--repeats", "1", "--warmup", "0", "--no-progress",
                        "--json", str(js), "--chart", str(out)],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                            "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert p.returncode == 0, p.stderr
    root = parse(out.read_text(encoding="utf-8"))
    assert {(b.get("data-runner"), b.get("data-batch")) for b in bars(root)} == {("fgchat-eager", "1"),
                                                                                ("fgchat-eager", "2")}
    # the chart of the run is the chart of its JSON
    assert out.read_text(encoding="utf-8") == bar_chart_svg([json.loads(js.read_text())])


def test_readme_chart_is_current():
    """tests/bench/data/chart-6d653ea.svg is what the renderer draws from its JSON today."""
    drawn = bar_chart_svg(load_results([str(p) for p in README_CHART_SOURCES]))
    rel = " ".join(str(p.relative_to(ROOT)) for p in README_CHART_SOURCES)
    assert README_CHART.read_text(encoding="utf-8") == drawn, (
        f"regenerate it: fgchat bench --chart {README_CHART.relative_to(ROOT)} --from-json {rel}")
    assert "commit 6d653ea" in drawn and "fgchat-mega" in drawn
