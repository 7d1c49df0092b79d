"""engine.cpu_malloc: a CPU engine keeps freed heap blocks of up to 32 MB for reuse (glibc)."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from fgchat.engine import core
from fgchat.engine.core import Engine, EngineConfig
from fgchat.protocol.tuning import Tuning

ROOT = Path(__file__).resolve().parent.parent

# a fresh process: 16 MB malloc'd, written and freed three times; prints the page faults of each
FAULTS = """
import ctypes, resource, sys
if sys.argv[1] == "1":
    from fgchat.engine.cpu_malloc import keep_freed_blocks
    assert keep_freed_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
faults = []
for size in (16 << 20, (16 << 20) + 4096, 16 << 20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    libc.memset(p, 1, size)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _faults(keep: bool) -> list[int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, "1" if keep else "0"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return [int(x) for x in out.split()]


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallopt")


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_freed_blocks_are_reused_without_faulting_again() -> None:
    pages = (16 << 20) // 4096
    kept = _faults(True)
    assert kept[0] >= pages // 2  # the first use of the memory faults it in
    assert max(kept[1:]) < pages // 20, kept  # later blocks of about that size reuse it
    default = _faults(False)
    assert min(default[1:]) >= pages // 2, default  # glibc's default maps and unmaps each one


def test_a_cpu_engine_sets_it_unless_switched_off(tiny_llama, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(core, "keep_freed_blocks", lambda: calls.append(1) or True)
    for on in (True, False):
        calls.clear()
        Engine(EngineConfig(model=str(tiny_llama), device="cpu", mode="eager", max_context=64,
                            tuning=Tuning(cpu_malloc=on), self_check=False))
        assert calls == ([1] if on else [])
