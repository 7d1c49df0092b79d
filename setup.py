"""Build hook: the built-in themes (themes/*.toml at the top of the repository, their source)
ship inside the package as fgchat/tui/builtin_themes/, where an installed fgchat finds them.
Everything else about the build is in pyproject.toml."""

from __future__ import annotations

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import FileError

THEME_SOURCES = "themes/*.toml"
THEME_PACKAGE_DIR = os.path.join("fgchat", "tui", "builtin_themes")


def _theme_files() -> list[str]:
    files = sorted(glob.glob(THEME_SOURCES))
    if not files:
        raise FileError(f"no built-in themes: {THEME_SOURCES} matches nothing")
    return files


class BuildPyWithThemes(build_py):
    """build_py that also copies themes/*.toml into the built package (an editable install reads
    themes/ in place, so it copies nothing there)."""

    def _theme_targets(self) -> list[tuple[str, str]]:
        target = os.path.join(self.build_lib, THEME_PACKAGE_DIR)
        return [(src, os.path.join(target, os.path.basename(src))) for src in _theme_files()]

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for src, dst in self._theme_targets():
            self.mkpath(os.path.dirname(dst))
            self.copy_file(src, dst)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return [*outputs, *(dst for _, dst in self._theme_targets())]

    def get_source_files(self) -> list[str]:
        # an sdist carries themes/, so a wheel built from it has them too
        return [*super().get_source_files(), *_theme_files()]


setup(cmdclass={"build_py": BuildPyWithThemes})
