"""Compiled bytecode for an install that ships none: fgchat's own cache of it.

Where torch was installed without bytecode (no `__pycache__` beside its sources) and Python may
not write any (PYTHONDONTWRITEBYTECODE, or a read-only install), every start compiles torch's
~2,000 modules again: 4.7 s of `import torch` on one GPU host against ~1 s from bytecode. There
`use_own_pycache` points Python's bytecode cache at `<fgchat cache>/pycache`
(`sys.pycache_prefix`) and lets it write there: the first start compiles once, later ones load.

Invariants:
- It only acts before torch is imported, when torch is installed and has no bytecode beside its
  `__init__.py`, and the user set no PYTHONPYCACHEPREFIX. Otherwise it changes nothing (an
  install with bytecode keeps using its own).
- With a prefix set, Python writes bytecode under the prefix only, never beside the sources, so
  PYTHONDONTWRITEBYTECODE's purpose (no files in the install) still holds.
- Bytecode there is checked against each source's mtime and size as usual: an upgraded package
  compiles again. A prefix that cannot be written is harmless (Python then compiles as before).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PACKAGE = "torch"


def lacks_bytecode(package: str = PACKAGE) -> bool:
    """True when `package` is installed and its `__init__` has no bytecode where Python looks
    for it now; nothing is imported."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return False
    try:
        return not os.path.exists(importlib.util.cache_from_source(origin))
    except (NotImplementedError, ValueError):  # no bytecode caching on this interpreter
        return False


def use_own_pycache(cache_root: Path | None = None, package: str = PACKAGE) -> Path | None:
    """Point Python's bytecode cache at `cache_root / "pycache"` (default: fgchat's cache root)
    where the invariants above allow it; returns that directory, or None when nothing changed."""
    if package in sys.modules:
        return None
    if sys.pycache_prefix is not None or os.environ.get("PYTHONPYCACHEPREFIX"):
        return None
    if not lacks_bytecode(package):
        return None
    if cache_root is None:
        from fgchat.engine.model.resolve import default_cache_root

        cache_root = default_cache_root()
    prefix = Path(cache_root).expanduser().absolute() / "pycache"
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    return prefix
