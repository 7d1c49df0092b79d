"""Model shape presets for random weights (`--preset`): config.json files of real models, shipped
inside the package so that an installed fgchat has them. Torch-free."""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_path(name: str) -> Path:
    """The preset's config.json (it may not exist: callers check)."""
    return PRESETS_DIR / f"{name}.json"
