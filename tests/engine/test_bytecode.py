"""fgchat's own bytecode cache for installs without bytecode (engine/bytecode.py).

Each case runs in a fresh interpreter with a throwaway package on its path and
PYTHONDONTWRITEBYTECODE=1 (as on the GPU hosts whose torch has no __pycache__), so this
process's import system is never touched.
"""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from fgchat.engine.bytecode import use_own_pycache
prefix = use_own_pycache(sys.argv[1], package="fakepkg")
import fakepkg
print(json.dumps({"prefix": prefix and str(prefix), "pycache_prefix": sys.pycache_prefix,
                  "dont_write": sys.dont_write_bytecode, "value": fakepkg.VALUE}))
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    pkg = tmp_path / "site" / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from fakepkg.part import VALUE\n")
    (pkg / "part.py").write_text("VALUE = 42\n")
    return tmp_path / "site"


def probe(site: Path, cache: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    environ.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), **env)
    out = subprocess.run([sys.executable, "-c", PROBE, str(cache)], env=environ, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compiled(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*.pyc"))


def test_a_package_without_bytecode_is_compiled_once_into_the_own_cache(site, tmp_path):
    cache = tmp_path / "cache"
    first = probe(site, cache)
    assert first["prefix"] == str(cache.absolute() / "pycache") == first["pycache_prefix"]
    assert first["dont_write"] is False and first["value"] == 42
    names = compiled(cache / "pycache")
    assert any(n.startswith("__init__.") for n in names) and any(n.startswith("part.") for n in names)
    assert not list(site.rglob("*.pyc")), "nothing is written beside the sources"
    stamps = {p: p.stat().st_mtime_ns for p in (cache / "pycache").rglob("*.pyc")}
    second = probe(site, cache)
    assert second["value"] == 42
    assert {p: p.stat().st_mtime_ns for p in (cache / "pycache").rglob("*.pyc")} == stamps, \
        "a later start loads the bytecode instead of writing it again"


def test_a_package_with_its_own_bytecode_is_left_alone(site, tmp_path):
    for source in site.rglob("*.py"):
        py_compile.compile(str(source), doraise=True)
    cache = tmp_path / "cache"
    result = probe(site, cache)
    assert result["prefix"] is None and result["pycache_prefix"] is None and result["dont_write"] is True
    assert not cache.exists()


def test_the_user_setting_wins(site, tmp_path):
    user = str(tmp_path / "user-prefix")
    cache = tmp_path / "cache"
    result = probe(site, cache, PYTHONPYCACHEPREFIX=user)
    assert result["prefix"] is None and result["value"] == 42
    assert not cache.exists()
    assert result["pycache_prefix"] == user


def test_nothing_changes_once_the_package_is_imported(tmp_path):
    from fgchat.engine.bytecode import use_own_pycache

    assert "torch" in sys.modules or pytest.importorskip("torch")
    before = (sys.pycache_prefix, sys.dont_write_bytecode)
    assert use_own_pycache(tmp_path) is None
    assert (sys.pycache_prefix, sys.dont_write_bytecode) == before
    assert not (tmp_path / "pycache").exists()
