"""The engine child's start-up helper thread (fgchat.engine.startup_prime), on the CPU.

What it does on a GPU (the CUDA context and Triton's key before the main thread needs them) is
timed by tools/startup_time.py there; here: when it runs, in which order, that it calls the
driver as the runtime expects, and that it leaves Triton's key computed.
"""

from __future__ import annotations

import threading

import pytest

from fgchat.engine import startup_prime as sp

GPU_MACHINE = dict(driver_present=True, torch_cuda=True, triton_present=True)


@pytest.mark.parametrize(("device", "ordinal"), [(None, 0), ("auto", 0), ("", 0), ("cuda", 0),
                                                 ("cuda:0", 0), (" cuda:3 ", 3)])
def test_plan_primes_the_engines_device(device, ordinal):
    assert sp.plan_for(device, **GPU_MACHINE) == sp.Plan(ordinal=ordinal, triton=True)


@pytest.mark.parametrize("device", ["cpu", "mps", "cuda:x", "meta"])
def test_no_plan_for_other_devices(device):
    assert sp.plan_for(device, **GPU_MACHINE) is None


def test_no_plan_without_a_driver_or_a_cuda_torch():
    assert sp.plan_for(None, driver_present=False, torch_cuda=True, triton_present=True) is None
    assert sp.plan_for("cuda", driver_present=True, torch_cuda=False, triton_present=True) is None
    assert sp.plan_for("cuda:1", driver_present=True, torch_cuda=True, triton_present=False) == sp.Plan(1, False)


def test_this_cpu_machine_gets_no_plan():
    """No NVIDIA driver here: the child starts no thread (CI and this machine have no GPU)."""
    assert sp.start("cuda") is None and sp.start(None) is None


def test_triton_waits_for_the_main_threads_imports():
    order: list[str] = []
    triton_ran = threading.Event()

    def triton() -> bool:
        order.append("triton")
        triton_ran.set()
        return True

    primer = sp.Primer(sp.Plan(2, True), mark=order.append,
                       cuda=lambda n: order.append(f"cuda {n}") is None, triton=triton).start()
    assert not triton_ran.wait(0.2), "Triton's part ran before the main thread's imports were done"
    assert order == ["cuda 2", "engine: cuda context primed"]
    primer.imports_done()
    primer.join(10)
    assert order == ["cuda 2", "engine: cuda context primed", "triton", "engine: triton key primed"]
    assert primer.results == {"cuda": True, "triton": True}


def test_a_failing_step_is_recorded_and_the_next_still_runs():
    def boom(_ordinal: int) -> bool:
        raise RuntimeError("driver trouble")

    primer = sp.Primer(sp.Plan(0, True), cuda=boom, triton=lambda: True).start()
    primer.imports_done()
    primer.join(10)
    assert primer.results == {"cuda": False, "triton": True}


class FakeDriver:
    """The three driver calls, each returning CUDA_SUCCESS (0) unless told otherwise."""

    def __init__(self, fail: str | None = None, devices: int = 2) -> None:
        self.calls: list[tuple] = []
        self.fail, self.devices = fail, devices

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        self.calls.append(("cuInit", flags))
        return 3 if self.fail == "cuInit" else 0

    def cuDeviceGet(self, dev_ref, ordinal):  # noqa: N802
        self.calls.append(("cuDeviceGet", ordinal))
        if ordinal >= self.devices:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        dev_ref._obj.value = 40 + ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx_ref, dev):  # noqa: N802
        self.calls.append(("cuDevicePrimaryCtxRetain", dev.value))
        return 0


def test_cuda_context_retains_the_ordinals_primary_context(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(sp.ctypes, "CDLL", lambda name: driver)
    assert sp.prime_cuda_context(1) is True
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 1), ("cuDevicePrimaryCtxRetain", 41)]


def test_cuda_context_stops_at_the_first_error(monkeypatch):
    driver = FakeDriver(fail="cuInit")
    monkeypatch.setattr(sp.ctypes, "CDLL", lambda name: driver)
    assert sp.prime_cuda_context(0) is False
    assert driver.calls == [("cuInit", 0)]
    driver = FakeDriver(devices=1)
    monkeypatch.setattr(sp.ctypes, "CDLL", lambda name: driver)
    assert sp.prime_cuda_context(3) is False
    assert [c[0] for c in driver.calls] == ["cuInit", "cuDeviceGet"]


def test_cuda_context_without_the_driver_library():
    assert sp.prime_cuda_context(0, library="libfgchat-no-such-driver.so.1") is False


def test_triton_key_is_left_computed():
    cache = pytest.importorskip("triton.runtime.cache")
    cache.triton_key.cache_clear()
    assert sp.prime_triton_key() is True
    info = cache.triton_key.cache_info()
    assert info.currsize == 1 and info.misses == 1
    cache.triton_key()
    assert cache.triton_key.cache_info().hits == 1, "the first kernel load would have computed it again"


def test_start_sets_lazy_module_loading_before_the_thread(monkeypatch):
    """The driver reads CUDA_MODULE_LOADING at cuInit; it is set on the calling thread before the
    helper exists (so no thread writes the environment), and a value the user set is kept."""
    seen = []

    class Recorder:
        def __init__(self, plan, mark):
            seen.append(sp.os.environ.get("CUDA_MODULE_LOADING"))

        def start(self):
            return self

    monkeypatch.setattr(sp, "Primer", Recorder)
    monkeypatch.setattr(sp, "plan_for", lambda device: sp.Plan(0, False))
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    sp.start("cuda")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    sp.start("cuda")
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    monkeypatch.setattr(sp, "plan_for", lambda device: sp.Plan(None, True))  # no context to prime
    sp.start("cuda")
    assert seen == ["LAZY", "EAGER", None]


def test_a_thread_starts_only_where_there_is_a_plan(monkeypatch):
    monkeypatch.setattr(sp, "plan_for", lambda device: None)
    assert sp.start("cuda") is None
    monkeypatch.setattr(sp, "plan_for", lambda device: sp.Plan(None, False))
    primer = sp.start("cuda")
    assert primer is not None
    primer.join(10)
