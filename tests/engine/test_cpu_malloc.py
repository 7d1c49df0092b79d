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

ROOT = Path(__file__).resolve().parents[2]

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
for size in (16 << 20, (16 << 20) + 4096, 16 << 20, 16 << 20):
    if len(faults) == 3 and sys.argv[2] == "release":
        from fgchat.engine.cpu_malloc import release_free_blocks
        assert release_free_blocks()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    libc.memset(p, 1, size)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _faults(keep: bool, release: bool = False) -> list[int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, "1" if keep else "0", "release" if release else "-"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
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
    assert min(default[1:3]) >= pages // 2, default  # glibc's default maps and unmaps them (at first)
    released = _faults(True, release=True)  # the free pages handed back: the next block faults again
    assert max(released[1:3]) < pages // 20 and released[3] >= pages // 2, released


def test_a_cpu_engine_sets_it(tiny_llama, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(core, "keep_freed_blocks", lambda: calls.append(1) or True)
    Engine(EngineConfig(model=str(tiny_llama), device="cpu", mode="eager", max_context=64, self_check=False))
    assert calls == [1]


def test_an_idle_engine_hands_the_free_pages_back_once_after_a_prefill(tiny_llama, monkeypatch) -> None:
    from fgchat.protocol.events import SamplingParams

    calls = []
    monkeypatch.setattr(core, "keep_freed_blocks", lambda: True)
    monkeypatch.setattr(core, "release_free_blocks", lambda: calls.append(1) or True)
    eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", mode="eager", max_context=64, self_check=False))
    assert not eng.capture_idle() and calls == []  # nothing prefilled yet
    eng.submit([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    assert not eng.capture_idle() and calls == []  # a request still runs
    eng.run_until_done()
    eng.capture_idle()
    eng.capture_idle()
    assert calls == [1]
