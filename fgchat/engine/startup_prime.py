"""Start-up work the engine child does on a helper thread while its main thread imports torch and
loads the model: the CUDA driver's start and the device's primary context, then Triton's own
cache key. Both would otherwise run later on the main thread, on the path to "ready".

Invariants:
- Nothing here imports torch. The CUDA part calls the driver library through ctypes, which
  releases the GIL for each call, so it overlaps torch's import.
- The Triton part waits until the main thread says torch and the engine are imported
  (`Primer.imports_done`), so two threads never import overlapping modules at the same time.
  Its cost is hashing Triton's compiler sources and its 400 MB shared library (hashlib and file
  reads release the GIL); Triton computes that key once per process, at the first kernel load.
- Every step is optional: where it is not wanted (CPU device, no driver, a torch without CUDA)
  or fails, it does nothing, and torch or Triton do the same work later as they would anyway.
  The context is the one the CUDA runtime (torch) uses: the device's primary context.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fgchat.engine import cuda_driver

_DEVICE_RE = re.compile(r"^cuda(?::(\d+))?$")


@dataclass(frozen=True)
class Plan:
    """What the helper thread will do: prime `ordinal`'s context (None: skip) and Triton's key."""

    ordinal: int | None
    triton: bool


def _torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, read from its files (torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    lib = Path(spec.origin).parent / "lib"
    return any(lib.glob("libtorch_cuda*.so*"))


def plan_for(device: str | None, *, driver_present: bool | None = None,
             torch_cuda: bool | None = None, triton_present: bool | None = None) -> Plan | None:
    """The plan for the engine's `device` setting (None/auto, cpu, cuda, cuda:N), or None.

    The keyword arguments stand in for what is otherwise looked up on this machine (tests).
    """
    name = device.strip() if isinstance(device, str) else device
    if name in (None, "", "auto"):
        ordinal = 0
    else:
        m = _DEVICE_RE.match(name)
        if m is None:  # cpu, or a name the engine rejects with its own message
            return None
        ordinal = int(m.group(1) or 0)
    if driver_present is None:
        driver_present = Path("/proc/driver/nvidia/version").exists()
    if torch_cuda is None:
        torch_cuda = driver_present and _torch_has_cuda()
    if not (driver_present and torch_cuda):
        return None
    if triton_present is None:
        triton_present = importlib.util.find_spec("triton") is not None
    return Plan(ordinal=ordinal, triton=triton_present)


def prime_cuda_context(ordinal: int, library: str = cuda_driver.LIBRARY) -> bool:
    """cuInit and retain device `ordinal`'s primary context; True when both succeeded.
    `start` has set CUDA_MODULE_LOADING (the driver reads it at cuInit) on the main thread."""
    lib = cuda_driver.open_driver(library)
    if lib is None or lib.cuInit(0) != 0:
        return False
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return False
    ctx = ctypes.c_void_p()
    # retained for the process's life: torch's runtime attaches to this same context
    return lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0


def prime_triton_key() -> bool:
    """Compute Triton's per-process cache key (it caches the result); True when it ran."""
    try:
        from triton.runtime.cache import triton_key
    except Exception:  # noqa: BLE001 - an unusable Triton is the engine's to report, later
        return False
    try:
        triton_key()
    except OSError:
        return False
    return True


class Primer:
    """The helper thread. `imports_done()` lets its Triton part start; `join` waits for it."""

    def __init__(self, plan: Plan, mark: Callable[[str], None] = lambda label: None,
                 cuda: Callable[[int], bool] = prime_cuda_context,
                 triton: Callable[[], bool] = prime_triton_key) -> None:
        self.plan = plan
        self.results: dict[str, bool] = {}
        self._imports = threading.Event()
        self._mark, self._cuda, self._triton = mark, cuda, triton
        self._thread = threading.Thread(target=self._run, name="fgchat-startup-prime", daemon=True)

    def start(self) -> Primer:
        self._thread.start()
        return self

    def imports_done(self) -> None:
        self._imports.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        if self.plan.ordinal is not None:
            self.results["cuda"] = self._step(lambda: self._cuda(self.plan.ordinal))
            self._mark("engine: cuda context primed")
        if self.plan.triton:
            self._imports.wait()
            self.results["triton"] = self._step(self._triton)
            self._mark("engine: triton key primed")

    @staticmethod
    def _step(fn: Callable[[], bool]) -> bool:
        try:
            return bool(fn())
        except Exception:  # noqa: BLE001 - priming is optional: the main thread redoes the work
            return False


def start(device: str | None, mark: Callable[[str], None] = lambda label: None) -> Primer | None:
    """Start priming for the engine's device setting; None where there is nothing to prime."""
    plan = plan_for(device)
    if plan is None:
        return None
    if plan.ordinal is not None:
        # torch's default, set before the thread exists: the environment is never written while
        # another thread may read it (setenv is not thread-safe), and torch then leaves it as is
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    return Primer(plan, mark).start()
