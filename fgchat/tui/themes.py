"""Textual themes loaded from TOML files (one theme per file).

Built-in themes: themes/*.toml at the top of the repository, which the build (setup.py) copies
into the package as fgchat/tui/builtin_themes/; users may drop more into <data dir>/themes/.
A file: `name`, `primary` (required), optional secondary, accent, warning, error, success,
foreground, background, surface, panel, boost, dark (bool), luminosity_spread, text_alpha and a
[variables] table. A bad file is skipped with a one-line reason; it never stops start-up.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.theme import Theme

_PACKAGED_THEME_DIR = Path(__file__).resolve().parent / "builtin_themes"  # a built install
_SOURCE_THEME_DIR = Path(__file__).resolve().parents[2] / "themes"  # a source tree, an editable install
# one Textual theme per TOML file
BUILTIN_THEME_DIR = _PACKAGED_THEME_DIR if _PACKAGED_THEME_DIR.is_dir() else _SOURCE_THEME_DIR
DEFAULT_THEME = "fgchat-midnight"

_COLOR_KEYS = ("primary", "secondary", "accent", "warning", "error", "success",
               "foreground", "background", "surface", "panel", "boost")


def load_theme_file(path: Path) -> Theme:
    """One Theme from a TOML file; ValueError with a one-line reason when it is not valid."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path.name}: {' '.join(str(exc).split())}") from None
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{path.name}: missing 'name'")
    if "primary" not in data:
        raise ValueError(f"{path.name}: missing 'primary' color")
    kwargs: dict = {"name": name.strip()}
    for key in _COLOR_KEYS:
        if key in data:
            value = data[key]
            try:
                Color.parse(value)
            except (ColorParseError, TypeError, ValueError):
                raise ValueError(f"{path.name}: bad color for {key!r}: {value!r}") from None
            kwargs[key] = value
    if "dark" in data:
        kwargs["dark"] = bool(data["dark"])
    for key in ("luminosity_spread", "text_alpha"):
        if key in data:
            kwargs[key] = float(data[key])
    variables = data.get("variables", {})
    if isinstance(variables, dict):
        kwargs["variables"] = {str(k): str(v) for k, v in variables.items()}
    return Theme(**kwargs)


def load_themes(dirs: Iterable[Path]) -> tuple[list[Theme], list[str]]:
    """Themes from every *.toml in `dirs` (later files of the same name win) and the problems."""
    themes: dict[str, Theme] = {}
    problems: list[str] = []
    for folder in dirs:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            try:
                theme = load_theme_file(path)
            except ValueError as exc:
                problems.append(f"theme skipped: {exc}")
                continue
            themes[theme.name] = theme
    return list(themes.values()), problems
