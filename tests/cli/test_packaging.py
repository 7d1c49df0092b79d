"""The built wheel carries the files fgchat reads at run time (an installed fgchat has no repo
around it): the presets, the palette's example prompts, the TUI's stylesheet and the built-in
themes (themes/*.toml, which the build copies into the package); and nothing but the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THEMES = sorted(p.name for p in (ROOT / "themes").glob("*.toml"))
# what a checkout holds besides the source of the wheel; copying it checks the build leaves it out
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist",
                                     ".pytest_cache", ".old", ".whl", ".gguf", ".llamacpp", "out")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built by pip from a copy of this checkout (docs/, tests/, tools/ included)."""
    pytest.importorskip("setuptools")  # the build backend (torch requires it, so it is there)
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return next((tmp / "dist").glob("fgchat-*.whl"))


def test_the_wheel_has_the_presets_prompts_and_stylesheet(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {f"fgchat/presets/{f.name}" for f in (ROOT / "fgchat" / "presets").glob("*.json")}
    assert presets and presets <= names, sorted(presets - names)
    assert {"fgchat/presets/__init__.py", "fgchat/tui/prompts.txt", "fgchat/tui/app.tcss"} <= names


def test_the_wheel_has_the_four_builtin_themes(wheel):
    assert THEMES == ["ember.toml", "midnight.toml", "paper.toml", "phosphor.toml"]
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {f"fgchat/tui/builtin_themes/{name}" for name in THEMES}
    assert packaged <= names, sorted(packaged - names)


def test_the_wheel_holds_only_the_package(wheel):
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    dist_info = {t for t in tops if t.startswith("fgchat-") and t.endswith(".dist-info")}
    assert len(dist_info) == 1 and tops - dist_info == {"fgchat"}, sorted(tops)


def test_themes_load_from_the_installed_package(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure wheel unpacked is its installed files
    code = ("import fgchat.tui.themes as t\n"
            "themes, problems = t.load_themes([t.BUILTIN_THEME_DIR])\n"
            "print(t.__file__); print(t.BUILTIN_THEME_DIR); print(problems)\n"
            "print(' '.join(sorted(theme.name for theme in themes)))\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    module, theme_dir, problems, names = p.stdout.splitlines()
    assert Path(module).is_relative_to(site), module  # the unpacked wheel's fgchat, not this checkout's
    assert Path(theme_dir) == site / "fgchat" / "tui" / "builtin_themes"
    assert problems == "[]"
    assert names.split() == ["fgchat-ember", "fgchat-midnight", "fgchat-paper", "fgchat-phosphor"]


def test_presets_and_prompts_load_from_the_package():
    from fgchat.presets import preset_names
    from fgchat.tui.palette import example_prompts

    assert {"llama-3.2-1b", "smollm2-135m", "tiny"} <= set(preset_names())
    assert len(example_prompts()) >= 3
