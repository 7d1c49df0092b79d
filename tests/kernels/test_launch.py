"""fgchat.engine.kernels.launch: the fast Triton launcher.

CPU: the cache key against Triton's own specialization, the exact launcher call on a hit (with a
fake compiled kernel), and every fallback to the plain path. GPU (-m gpu): bit-exact against
plain launches, fast path taken on the second call, CUDA-graph capture + replay, launch overhead.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import subprocess
import sys
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from fgchat.engine.kernels import launch, launch_timing  # noqa: E402
from fgchat.engine.kernels.launch import FastLauncher, _arg_code, _Unsupported, fast  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, y_ptr, n, scale, flag, opt, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i))


@triton.jit
def _const_first_kernel(N: tl.constexpr, x_ptr):
    tl.store(x_ptr + tl.arange(0, N), tl.zeros([N], tl.float32))


def _jit_available() -> bool:
    return launch.ENABLED and isinstance(_probe_kernel, triton.runtime.jit.JITFunction)


needs_jit = pytest.mark.skipif(not _jit_available(),
                               reason="kernels decorated under TRITON_INTERPRET, or fast launch disabled")


@pytest.mark.skipif(_jit_available() or not launch.ENABLED,
                    reason="the JIT tests run in this process; or fast launch is disabled")
def test_jit_tests_run_in_a_process_without_the_interpreter():
    """In the full suite an earlier test module sets TRITON_INTERPRET before this one loads, so
    this module's kernels are interpreted and every JIT test above and below skips here. They run
    in a child pytest with the flag unset instead, and must all pass there, none skipped."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-m", "not gpu",
                        "-k", "not jit_tests_run_in_a_process", "-rs"],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    summary = p.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


def tensors() -> list[torch.Tensor]:
    base16 = torch.zeros(64, dtype=torch.float16)
    base32 = torch.zeros(64, dtype=torch.float32)
    out = [base16, base16[8:], base16[1:], base16[4:], base32, base32[4:], base32[1:], base32[2:],
           torch.zeros(64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32),
           torch.nn.Parameter(torch.zeros(8))]
    assert base16.data_ptr() % 16 == 0 and base32.data_ptr() % 16 == 0
    return out


def descriptors() -> list:
    """Host tensor descriptors: dtypes, block shapes, paddings, shapes and strides."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w16 = torch.zeros(128, 256, dtype=torch.bfloat16)
    w32 = torch.zeros(128, 256, dtype=torch.float32)
    return [TensorDescriptor.from_tensor(w16, [64, 128]), TensorDescriptor.from_tensor(w16[:64], [64, 128]),
            TensorDescriptor.from_tensor(w16, [64, 64]), TensorDescriptor.from_tensor(w32, [64, 128]),
            TensorDescriptor.from_tensor(w32, [64, 128], padding="nan")]


SCALARS = [0, 1, 2, 3, 15, 16, 17, 32, -1, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
           -(2**31) - 16, 2**32, 2**63 - 1, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 1, 2**64 - 16,
           True, False, 0.0, 1.0, -0.5, 1e300, None]


def native(a, is_const=False, specialize=True, align=True):
    return native_specialize_impl(BaseBackend, a, is_const, specialize, align)


@needs_jit
def test_inline_key_matches_arg_code():
    la = FastLauncher(_probe_kernel)
    for a in tensors() + SCALARS + descriptors():
        assert la.cache_key((a,), {}, 0)[2] == _arg_code(a), a


@needs_jit
def test_key_never_coarser_than_triton_specialization():
    """Equal key elements imply equal Triton specialization, for every specialize/align/const flag."""
    values = tensors() + SCALARS + descriptors()
    la = FastLauncher(_probe_kernel)
    for a, b in itertools.combinations(values, 2):
        if la.cache_key((a,), {}, 0) != la.cache_key((b,), {}, 0):
            continue
        for is_const, spec, align in itertools.product((False, True), repeat=3):
            if is_const and not isinstance(a, torch.Tensor):
                continue
            assert native(a, is_const, spec, align) == native(b, is_const, spec, align), (a, b)


@needs_jit
def test_key_distinguishes_what_triton_does():
    la = FastLauncher(_probe_kernel)

    def key(*args, **kw):
        return la.cache_key(args, kw, 0)

    t16, t16_8, t16_1, t16_4, t32, t32_4, *_ = tensors()
    other16 = torch.zeros(32, dtype=torch.float16)
    # tensors: dtype and 16-byte alignment
    assert key(t16) == key(t16_8) == key(other16)
    assert key(t16) != key(t16_1) and key(t16) != key(t16_4) and key(t16) != key(t32)
    assert key(t16_1) == key(t16_4)  # neither is 16-byte aligned: same triton specialization
    assert key(t32) == key(t32_4) != key(t32[1:]) == key(t32[2:])  # 16 bytes in / 4 and 8 bytes in
    # ints: == 1 (constexpr), % 16 (divisibility), range (i32 / i64 / u64)
    assert key(1) != key(2) and key(2) != key(16) and key(1) != key(16)
    assert key(2) == key(3) == key(-1) and key(16) == key(32) == key(0) == key(-16)
    assert key(16) != key(2**32) and key(2**31 + 16) == key(2**32) and key(2**31) == key(2**32)
    assert key(2**31 - 1) != key(2**31 + 1)  # i32 vs i64
    assert key(2**63) != key(2**32) and key(2**63 + 16) == key(2**63)
    with pytest.raises(_Unsupported):
        key(2**64)
    # bool / float / None are each one class, and distinct from ints
    assert key(True) == key(False) != key(1)
    assert key(0.5) == key(1e300) != key(1)
    assert key(None) != key(0)
    # keyword arguments: names, values and types
    assert key(t16, BLOCK=16) != key(t16, BLOCK=32)
    assert key(t16, BLOCK=16, num_warps=4) != key(t16, BLOCK=16, num_warps=8)
    assert key(t16, BLOCK=16) != key(t16, BLOCK=16, num_warps=4)
    assert key(t16, BLOCK=True) != key(t16, BLOCK=1) != key(t16, BLOCK=1.0)
    assert key(t16, BLOCK=0.0) != key(t16, BLOCK=-0.0)
    assert key(t16, BLOCK=16) == key(other16, BLOCK=16)
    # descriptors: dtype, block shape and padding; not the address, shape or strides
    d16, d16_half, d16_64, d32, d32_nan = descriptors()
    assert key(d16) == key(d16_half) != key(d16_64)
    assert key(d16) != key(d32) != key(d32_nan) and key(d16) != key(t16)
    # the number of positional arguments and the device
    assert key(t16, 16) != key(t16)
    assert la.cache_key((t16,), {}, 0) != la.cache_key((t16,), {}, 1)


@needs_jit
def test_key_follows_debug_knobs(monkeypatch):
    la = FastLauncher(_probe_kernel)
    k0 = la.cache_key((1,), {"BLOCK": 16}, 0)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert la.cache_key((1,), {"BLOCK": 16}, 0) != k0


@needs_jit
def test_unsupported_arguments():
    la = FastLauncher(_probe_kernel)
    t = torch.zeros(4)
    import numpy as np
    for bad in [(1, 2), np.int32(3), np.float64(1.0), "s"]:
        with pytest.raises(_Unsupported):
            la.cache_key((bad,), {}, 0)
    with pytest.raises(_Unsupported):  # a non-constexpr parameter by keyword
        la.cache_key((t,), {"y_ptr": t}, 0)
    with pytest.raises(_Unsupported):
        la.cache_key((t,) * 9, {}, 0)


@needs_jit
def test_positional_constexpr_keyed_by_value():
    la = FastLauncher(_const_first_kernel)
    t = torch.zeros(4)
    assert la.cache_key((16, t), {}, 0) != la.cache_key((32, t), {}, 0)
    assert la.cache_key((16, t), {}, 0) != la.cache_key((True, t), {}, 0)
    assert la.cache_key((16, t), {}, 0) == la.cache_key((16, torch.zeros(8)), {}, 0)


class FakeCompiled:
    """Stands in for triton's CompiledKernel: records the launcher calls."""

    def __init__(self):
        self.calls = []
        self.function = 0xF00
        self.packed_metadata = (4, 1, 0)

    def run(self, *args):
        self.calls.append(args)


@contextlib.contextmanager
def launch_hook(name: str):
    """A no-op hook registered in triton.knobs.runtime.<name> for the duration."""
    hook = lambda metadata: None  # noqa: E731
    getattr(knobs.runtime, name).add(hook)
    try:
        yield
    finally:
        getattr(knobs.runtime, name).remove(hook)


@pytest.fixture
def fake_plain(monkeypatch):
    """A JITFunction whose plain path returns a FakeCompiled; the CUDA lookups faked too."""
    compiled = FakeCompiled()
    plain_calls = []

    def plain_run(*args, grid, warmup, **kwargs):
        plain_calls.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(_probe_kernel, "run", plain_run)
    monkeypatch.setattr(launch, "_get_device", lambda: 0)
    monkeypatch.setattr(launch, "_get_raw_stream", lambda dev: 1234 + dev)
    monkeypatch.setattr(launch, "_driver_is_default_cuda", lambda: True)
    return FastLauncher(_probe_kernel), compiled, plain_calls


@needs_jit
def test_hit_calls_launcher_with_triton_convention(fake_plain):
    la, compiled, plain_calls = fake_plain
    x, y = torch.zeros(16), torch.zeros(16)
    args = (x, y, 16, 0.5, True, None)
    assert la[(3, 2)](*args, BLOCK=16, num_warps=4) is compiled
    assert len(plain_calls) == 1 and compiled.calls == [] and la.misses == 1
    assert la[(3, 2)](*args, BLOCK=16, num_warps=4) is compiled
    assert len(plain_calls) == 1 and la.fast_launches == 1
    # grid padded to 3, current stream, function, packed metadata, no launch metadata / hooks,
    # then EVERY parameter in order: constexpr BLOCK and the defaulted constexpr EXTRA included
    assert compiled.calls == [(3, 2, 1, 1234, 0xF00, (4, 1, 0), None, None, None, *args, 16, 3)]
    la[(5,)](*args, BLOCK=16, num_warps=4)
    assert compiled.calls[-1][:3] == (5, 1, 1)
    # a different specialization misses, then hits
    la[(5,)](x, y, 17, 0.5, True, None, BLOCK=16, num_warps=4)
    assert la.misses == 2 and len(plain_calls) == 2
    la[(5,)](x, y, 19, 0.5, True, None, BLOCK=16, num_warps=4)
    assert la.misses == 2 and la.fast_launches == 3
    la[(5,)](x[1:], y, 19, 0.5, True, None, BLOCK=16, num_warps=4)  # misaligned pointer
    assert la.misses == 3


@needs_jit
def test_bind_fixes_arguments_and_reads_stream_per_call(fake_plain, monkeypatch):
    la, compiled, plain_calls = fake_plain
    x, y = torch.zeros(16), torch.zeros(16)
    args = (x, y, 16, 0.5, True, None)
    early = la.bind((3, 2), *args, BLOCK=16, num_warps=4)  # no launch with this key yet
    assert early() is compiled and len(plain_calls) == 1 and la.misses == 1
    assert early() is compiled and la.fast_launches == 1  # through the keyed path, now a hit
    bound = la.bind((3, 2), *args, BLOCK=16, num_warps=4)
    assert bound is not early
    assert bound() is compiled and la.fast_launches == 2 and len(plain_calls) == 1
    assert compiled.calls[-1] == (3, 2, 1, 1234, 0xF00, (4, 1, 0), None, None, None, *args, 16, 3)
    monkeypatch.setattr(launch, "_get_raw_stream", lambda dev: 99)
    bound()
    assert compiled.calls[-1][3] == 99 and la.fast_launches == 3
    # a launch hook, or another current device, sends the bound call through the plain path
    with launch_hook("launch_enter_hook"):
        bound()
    assert len(plain_calls) == 2 and la.fast_launches == 3
    with monkeypatch.context() as m:
        m.setattr(launch, "_get_device", lambda: 1)
        bound()
    assert len(plain_calls) == 3 and la.fast_launches == 3
    bound()
    assert la.fast_launches == 4
    # arguments the fast path does not model: every call takes the keyed (here plain) path
    odd = la.bind((1,), x, y, 16, 0.5, True, (1, 2), BLOCK=16)
    odd()
    odd()
    assert len(plain_calls) == 5 and la.fast_launches == 4


@needs_jit
def test_bind_passes_device_tensors_as_addresses_and_keeps_them_alive(fake_plain, monkeypatch):
    """Bound launches hand the C launcher each device tensor's address (an int: no data_ptr()
    call and no driver query per launch); the tensors themselves stay referenced."""
    la, compiled, plain_calls = fake_plain
    monkeypatch.setattr(launch, "_on_device", lambda t: True)  # CPU tensors stand in for CUDA ones
    x, y = torch.zeros(16), torch.zeros(16)
    la[(3,)](x, y, 16, 0.5, True, None, BLOCK=16)  # the first launch of the key: plain
    bound = la.bind((3,), x, y, 16, 0.5, True, None, BLOCK=16)
    as_tensors = la.bind((3,), x, y, 16, 0.5, True, None, BLOCK=16, resolve_pointers=False)
    xp, yp = x.data_ptr(), y.data_ptr()
    alive = weakref.ref(x)
    del x, y
    gc.collect()
    assert alive() is not None, "the bound launch must keep its tensors alive"
    bound()
    args = compiled.calls[-1][9:15]
    assert args == (xp, yp, 16, 0.5, True, None) and all(type(a) is int for a in args[:2])
    as_tensors()
    assert [type(a) for a in compiled.calls[-1][9:11]] == [torch.Tensor, torch.Tensor]
    assert la.fast_launches == 2 and len(plain_calls) == 1
    del bound, as_tensors, args
    compiled.calls.clear()
    plain_calls.clear()  # the fakes' own records of the arguments
    gc.collect()
    assert alive() is None, "nothing but the bound launches held them"


@needs_jit
def test_bind_leaves_cpu_tensors_for_the_launchers_own_error(fake_plain):
    la, compiled, _ = fake_plain
    x, y = torch.zeros(16), torch.zeros(16)
    la[(3,)](x, y, 16, 0.5, True, None, BLOCK=16)
    la.bind((3,), x, y, 16, 0.5, True, None, BLOCK=16)()
    assert compiled.calls[-1][9] is x and compiled.calls[-1][10] is y


@needs_jit
def test_batched_replays_in_order_checking_once(fake_plain, monkeypatch):
    """launch.batched runs bound launches and other calls in their order, reads the stream once
    per replay, counts the fast launches, and falls back to each call's own checks when a hook
    or another device is current."""
    la, compiled, plain_calls = fake_plain
    x, y = torch.zeros(16), torch.zeros(16)
    la[(1,)](x, y, 16, 0.5, True, None, BLOCK=16)
    la[(2,)](x, y, 32, 0.5, True, None, BLOCK=16)
    other = FastLauncher(_probe_kernel)  # a second launcher: counted on its own
    other[(3,)](x, y, 16, 0.5, True, None, BLOCK=16)
    first = la.bind((1,), x, y, 16, 0.5, True, None, BLOCK=16)
    second = la.bind((2,), x, y, 32, 0.5, True, None, BLOCK=16)
    third = other.bind((3,), x, y, 16, 0.5, True, None, BLOCK=16)
    op = partial(compiled.calls.append, "op")
    reads = []
    monkeypatch.setattr(launch, "_get_raw_stream", lambda dev: reads.append(dev) or 77)
    replay = launch.batched([first, op, second, third, op])
    compiled.calls.clear()
    la.fast_launches = other.fast_launches = 0
    plain_before = len(plain_calls)
    replay()
    grids = [c if c == "op" else c[:4] for c in compiled.calls]
    assert grids == [(1, 1, 1, 77), "op", (2, 1, 1, 77), (3, 1, 1, 77), "op"]
    assert compiled.calls[2][9:15] == (x, y, 32, 0.5, True, None)
    assert reads == [0] and la.fast_launches == 2 and other.fast_launches == 1
    replay()
    assert len(reads) == 2 and la.fast_launches == 4 and other.fast_launches == 2 and len(compiled.calls) == 10
    with launch_hook("launch_enter_hook"):  # each bound launch then takes the plain path
        replay()
    assert len(plain_calls) == plain_before + 3 and compiled.calls[-1] == "op" and la.fast_launches == 4
    with monkeypatch.context() as m:
        m.setattr(launch, "_get_device", lambda: 1)
        replay()
    assert len(plain_calls) == plain_before + 6 and la.fast_launches == 4
    ops_only = launch.batched([op, op])
    compiled.calls.clear()
    ops_only()
    assert compiled.calls == ["op", "op"]


class FakeCudaLauncher:
    """Triton 3.6's CudaLauncher with its own `__call__` (scratch allocation, then the C launch),
    the C `launch` replaced by a recorder."""

    __call__ = None  # set below, when triton's NVIDIA driver module imports

    def __init__(self, scratch: int = 0):
        self.launches = []
        self.launch = lambda *a: self.launches.append(a)
        self.num_ctas = 1
        self.global_scratch_size, self.global_scratch_align = scratch, 128
        self.profile_scratch_size, self.profile_scratch_align = 0, 1
        self.launch_cooperative_grid, self.launch_pdl = False, True


@needs_jit
@pytest.mark.parametrize("scratch", [0, 64])
def test_fast_path_calls_the_c_launch_as_the_launchers_call_does(fake_plain, monkeypatch, scratch):
    """Without scratch memory the fast path calls the launcher's C `launch` directly, with the
    arguments Triton's own `CudaLauncher.__call__` passes it; with scratch it goes through
    `__call__` (which allocates it)."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    monkeypatch.setattr(FakeCudaLauncher, "__call__", driver.CudaLauncher.__call__)
    allocated = []
    monkeypatch.setattr(driver._allocation, "_allocator",
                        type("A", (), {"get": lambda self: lambda size, align, stream: allocated.append(size) or 4096})())
    la, compiled, plain_calls = fake_plain
    launcher = FakeCudaLauncher(scratch)
    compiled.run = launcher
    x, y = torch.zeros(16), torch.zeros(16)
    args = (x, y, 16, 0.5, True, None)
    la[(3, 2)](*args, BLOCK=16, num_warps=4)  # plain: the entry is made from this compiled kernel
    la[(3, 2)](*args, BLOCK=16, num_warps=4)
    bound = la.bind((3, 2), *args, BLOCK=16, num_warps=4, resolve_pointers=False)
    bound()
    launch.batched([bound])()
    via_call = []
    launcher.launch = lambda *a: via_call.append(a)
    driver.CudaLauncher.__call__(launcher, 3, 2, 1, 1234, 0xF00, (4, 1, 0), None, None, None, *args, 16, 3)
    launcher.launch = lambda *a: launcher.launches.append(a)
    assert launcher.launches == via_call * 3 and len(plain_calls) == 1 and la.fast_launches == 3
    assert via_call[0][:9] == (3, 2, 1, 1234, 0xF00, False, True, 4096 if scratch else None, None)
    assert len(allocated) == (4 if scratch else 0)


@needs_jit
def test_fallbacks_to_plain(fake_plain, monkeypatch):
    la, compiled, plain_calls = fake_plain
    x, y = torch.zeros(16), torch.zeros(16)
    args = (x, y, 16, 0.5, True, None)
    la[(1,)](*args, BLOCK=16)
    la[(1,)](*args, BLOCK=16)
    assert la.fast_launches == 1 and len(plain_calls) == 1

    def expect_plain(grid=(1,), *a, **kw):
        before_plain, before_fast = len(plain_calls), la.fast_launches
        la[grid](*(a or args), **(kw or {"BLOCK": 16}))
        assert len(plain_calls) == before_plain + 1 and la.fast_launches == before_fast

    expect_plain(lambda meta: (1,))  # callable grid
    expect_plain([1])  # list grid
    expect_plain((1, 1, 1, 1))
    expect_plain((1,), x, y, 16, 0.5, True, (1, 2))  # tuple argument
    expect_plain((1,), x, y, 16, 0.5, True, None, y_ptr=None)  # bad keyword: plain raises normally

    for name in ("launch_enter_hook", "launch_exit_hook"):
        with launch_hook(name):
            expect_plain()
    hook = lambda metadata: None  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "launch_enter_hook", hook)  # a bare callable, old style
        expect_plain()
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "1")
        expect_plain()
    with monkeypatch.context() as m:
        m.setitem(knobs.runtime.__dict__, "interpret", True)
        expect_plain()
    _probe_kernel.pre_run_hooks.append(lambda *a, **k: None)
    try:
        expect_plain()
    finally:
        _probe_kernel.pre_run_hooks.clear()
    # all clear again: fast
    before = la.fast_launches
    la[(1,)](*args, BLOCK=16)
    assert la.fast_launches == before + 1


@needs_jit
def test_compiled_without_handles_stays_plain(monkeypatch):
    plain_calls = []

    def plain_run(*args, grid, warmup, **kwargs):
        plain_calls.append(1)
        return object()  # no run / function / packed_metadata

    monkeypatch.setattr(_probe_kernel, "run", plain_run)
    monkeypatch.setattr(launch, "_get_device", lambda: 0)
    monkeypatch.setattr(launch, "_get_raw_stream", lambda dev: 0)
    monkeypatch.setattr(launch, "_driver_is_default_cuda", lambda: True)
    la = FastLauncher(_probe_kernel)
    x = torch.zeros(16)
    for _ in range(3):
        la[(1,)](x, x, 16, 0.5, True, None, BLOCK=16)
    assert len(plain_calls) == 3 and la.fast_launches == 0 and la.misses == 1


def test_fast_returns_one_launcher_per_kernel():
    assert fast(_probe_kernel) is fast(_probe_kernel)
    assert fast(_probe_kernel) is not fast(_const_first_kernel)


def test_interpreter_mode_uses_plain_path(monkeypatch):
    """Kernels made under TRITON_INTERPRET=1 are InterpretedFunctions: always the plain path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    @triton.jit
    def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) * 2, mask=m)

    assert not isinstance(double, triton.runtime.jit.JITFunction)
    la = FastLauncher(double)
    x = torch.arange(10, dtype=torch.float32)
    for _ in range(2):
        y = torch.zeros(10)
        la[(1,)](x, y, 10, BLOCK=16)
        assert torch.equal(y, x * 2)
    assert la.fast_launches == 0 and la.plain_launches == 2


# ------------------------------------------------------------------------------------- GPU

GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
             pytest.mark.skipif(not launch.ENABLED, reason="fast launch disabled (triton version or env)")]


def gpu_test(f):
    for mark in GPU_MARKS:
        f = mark(f)
    return f


def _fused_cases():
    """(name, fn) pairs; fn() runs one public entry point on fresh outputs and returns them."""
    from fgchat.engine.kernels import fused
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    h = torch.randn(5, 2048, device="cuda", generator=g).to(bf)
    d = torch.randn(5, 2048, device="cuda", generator=g).to(bf)
    w = (torch.rand(2048, device="cuda", generator=g) + 0.5).to(bf)
    gu = torch.randn(3, 2 * 1536, device="cuda", generator=g).to(bf)
    hq, hkv, dh, t = 8, 2, 64, 256
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, device="cuda").float() / dh))
    fr = torch.arange(t, device="cuda").float()[:, None] * inv[None]
    cos, sin = torch.cat([fr, fr], -1).cos().to(bf), torch.cat([fr, fr], -1).sin().to(bf)
    qkv = torch.randn(4, (hq + 2 * hkv) * dh, device="cuda", generator=g).to(bf)
    pos = torch.tensor([0, 5, 77, 255], device="cuda")
    slots = torch.tensor([3, 0, 1, 2], device="cuda")
    kc = torch.randn(4, t, hkv, dh, device="cuda", generator=g).to(bf)
    vc = torch.randn(4, t, hkv, dh, device="cuda", generator=g).to(bf)
    q1 = torch.randn(4, hq, dh, device="cuda", generator=g).to(bf)
    lens = torch.tensor([1, 100, 256, 17], device="cuda", dtype=torch.int32)
    attn = TritonDecodeAttention(torch.device("cuda"))

    def rope():
        k2, v2 = kc.clone(), vc.clone()
        q = fused.rope_kv_write(qkv, cos, sin, pos, slots, k2, v2, hq, hkv, dh)
        return q, k2, v2

    def attention():
        out = torch.empty(4, hq, dh, device="cuda", dtype=bf)
        attn(q1, kc, vc, slots.to(torch.int32), lens, out, dh ** -0.5)
        return (out,)

    return [
        ("add_rms_norm", lambda: fused.add_rms_norm(h, d, w, 1e-5)),
        ("add_rms_norm_nodelta", lambda: fused.add_rms_norm(h, None, w, 1e-5)[1:]),
        ("silu_mul", lambda: (fused.silu_mul(gu),)),
        ("rope_kv_write", rope),
        ("attention", attention),
    ]


def _launchers():
    from fgchat.engine.kernels import fused
    from fgchat.engine.kernels.attention import triton_decode

    return {k: fast(k) for k in (fused._add_rms_norm_kernel, fused._silu_mul_kernel, fused._rope_kv_kernel,
                                 triton_decode._split_kernel, triton_decode._combine_kernel)}


def _plain_fast(monkeypatch):
    """Make every call site launch through the plain path (fast -> identity)."""
    from fgchat.engine.kernels import fused
    from fgchat.engine.kernels.attention import triton_decode

    monkeypatch.setattr(fused, "fast", lambda k: k)
    monkeypatch.setattr(triton_decode, "fast", lambda k: k)


@pytest.mark.parametrize("case", range(5))
@gpu_test
def test_gpu_fast_matches_plain_bit_exact(case, monkeypatch):
    name, fn = _fused_cases()[case]
    with monkeypatch.context() as m:
        _plain_fast(m)
        ref = [t.clone() for t in fn()]
    launchers = _launchers()
    before = {k: la.fast_launches for k, la in launchers.items()}
    first = [t.clone() for t in fn()]
    second = [t.clone() for t in fn()]
    torch.cuda.synchronize()
    for r, a, b in zip(ref, first, second):
        assert torch.equal(r, a) and torch.equal(r, b), name
    # the kernels of this case took the fast path on the second call at the latest
    used = [k for k, la in launchers.items() if la.fast_launches > before[k]]
    assert used, f"{name}: no fast launch"


@gpu_test
def test_gpu_second_call_is_fast():
    from fgchat.engine.kernels.fused import _add_rms_norm_kernel

    la = FastLauncher(_add_rms_norm_kernel)
    h = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    y1, y2 = torch.empty_like(h), torch.empty_like(h)
    k1 = la[(2,)](h, h, w, h, y1, 1024, 1e-5, 0, HAS_DELTA=False, BLOCK=1024, num_warps=4)
    assert (la.misses, la.fast_launches, la.plain_launches) == (1, 0, 1)
    k2 = la[(2,)](h, h, w, h, y2, 1024, 1e-5, 0, HAS_DELTA=False, BLOCK=1024, num_warps=4)
    assert (la.misses, la.fast_launches, la.plain_launches) == (1, 1, 1)
    assert k1 is k2
    torch.cuda.synchronize()
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("case", range(5))
@gpu_test
def test_gpu_graph_capture_replay(case, monkeypatch):
    """Fast launches inside torch.cuda.graph capture (a side stream) replay to the plain results."""
    name, fn = _fused_cases()[case]
    with monkeypatch.context() as m:
        _plain_fast(m)
        ref = [t.clone() for t in fn()]
    launchers = _launchers()
    fn()  # warm: compiled and cached eagerly
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    before = sum(la.fast_launches for la in launchers.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    assert sum(la.fast_launches for la in launchers.values()) > before, f"{name}: capture not fast"
    for o in outs:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for r, o in zip(ref, outs):
        assert torch.equal(r, o), name
    # eager after capture goes to the (default) current stream again
    again = fn()
    torch.cuda.synchronize()
    for r, o in zip(ref, again):
        assert torch.equal(r, o), name


@gpu_test
def test_gpu_launch_overhead():
    """Prints the host time per launch (a benchmark, not asserted: it depends on the host);
    measure_launch_us itself fails if the fast path was not taken."""
    rows = []
    for r, n in ((1, 2048), (8, 4096)):
        res = launch_timing.measure_launch_us(rows=r, n_cols=n)
        rows.append((r, n, res))
    print("\n_add_rms_norm_kernel host time per launch (us)")
    print(f"{'rows':>5} {'n':>6} {'plain':>8} {'fast':>8} {'x':>6} {'bound,t':>8} {'bound,a':>8}")
    for r, n, res in rows:
        print(f"{r:>5} {n:>6} {res['plain_us']:>8.2f} {res['fast_us']:>8.2f} {res['speedup']:>6.1f}"
              f" {res['bound_tensors_us']:>8.2f} {res['bound_us']:>8.2f}")
    assert all(res["fast_us"] > 0 and res["plain_us"] > 0 for _, _, res in rows)


@gpu_test
def test_gpu_bound_launch_with_addresses_matches_plain():
    """A bound launch (device tensors passed as addresses) writes what the plain launch writes,
    eagerly and replayed from a CUDA graph, and keeps writing into the tensors it was bound to."""
    from fgchat.engine.kernels.fused import _add_rms_norm_kernel

    la = FastLauncher(_add_rms_norm_kernel)
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(4, 2048, device="cuda", generator=g).to(torch.bfloat16)
    d = torch.randn(4, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(2048, device="cuda", generator=g).to(torch.bfloat16)
    ref_h, ref_y = torch.empty_like(h), torch.empty_like(h)
    kw = dict(HAS_DELTA=True, BLOCK=2048, num_warps=4)
    _add_rms_norm_kernel[(4,)](h, d, w, ref_h, ref_y, 2048, 1e-5, 0, **kw)
    out_h, out_y = torch.empty_like(h), torch.empty_like(h)
    la[(4,)](h, d, w, out_h, out_y, 2048, 1e-5, 0, **kw)  # the key's first launch: plain
    bound = la.bind((4,), h, d, w, out_h, out_y, 2048, 1e-5, 0, **kw)
    out_h.zero_(), out_y.zero_()
    bound()
    torch.cuda.synchronize()
    assert la.fast_launches == 1
    assert torch.equal(out_h, ref_h) and torch.equal(out_y, ref_y)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        bound()
    torch.cuda.current_stream().wait_stream(s)
    out_h.zero_(), out_y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_h, ref_h) and torch.equal(out_y, ref_y)
