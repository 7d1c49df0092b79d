"""The built wheel carries the files fgchat reads at run time (an installed fgchat has no repo
around it): the presets, the palette's example prompts and the TUI's stylesheet."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_has_the_presets_prompts_and_stylesheet(tmp_path):
    pytest.importorskip("setuptools")  # the build backend (torch requires it, so it is there)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fgchat", src / "fgchat", ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("fgchat-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {f"fgchat/presets/{f.name}" for f in (ROOT / "fgchat" / "presets").glob("*.json")}
    assert presets and presets <= names, sorted(presets - names)
    assert {"fgchat/presets/__init__.py", "fgchat/tui/prompts.txt", "fgchat/tui/app.tcss"} <= names


def test_presets_and_prompts_load_from_the_package():
    from fgchat.presets import preset_names
    from fgchat.tui.palette import example_prompts

    assert {"llama-3.2-1b", "smollm2-135m", "tiny"} <= set(preset_names())
    assert len(example_prompts()) >= 3
