"""Low-overhead launches of Triton JIT kernels: `fast(kernel)[grid](*args, **kwargs)`.

`kernel[grid](...)` runs `JITFunction.run` on every launch: it fetches device and stream through
the driver, binds the arguments with the generated binder, builds and stringifies the cache key,
builds launch metadata for the hooks, and only then calls the compiled launcher. That costs tens
of microseconds per launch, which dominates an eager decode step of ~100 launches.

`fast(kernel)` returns a `FastLauncher`, used exactly like the JITFunction. The first launch of a
given specialization goes through the plain path (`kernel[grid](...)`, which compiles if needed and
returns the `CompiledKernel`); the launcher stores that kernel under its own, cheaper key, and
later launches with the same key call the compiled launcher directly, as `JITFunction.run` does
(triton 3.6, `triton/runtime/jit.py`):

    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *bound_args)

where `bound_args` holds EVERY parameter of the kernel in signature order, constexpr ones and
defaults included (the generated C launcher parses a constexpr argument as an object and ignores
it). With no launch hook registered the fast path passes None for launch_metadata and both hooks;
the C launcher then skips the hook calls, which is what the plain path's empty HookChains amount to.
`compiled.run` is a CudaLauncher, whose Python `__call__` allocates the kernel's global and
profile scratch (when it has any) and calls its C `launch`; for a kernel with neither, the fast
path calls that C `launch` itself with what `__call__` would pass (no scratch: None, None).

Invariants
- The key is never coarser than Triton's own specialization (it may be finer, which only costs an
  extra plain launch). It covers: the current CUDA device (Triton compiles and loads per current
  device, `torch.cuda.current_device()`, not the tensors' device); the number of positional
  arguments; for each positional argument of a non-constexpr parameter, what `specialize_impl`
  looks at: tensors -> (dtype, data_ptr() % 16 == 0); exact ints -> value == 1 (specialized to a
  constexpr), % 16 == 0 (the "D" divisibility attribute) and range class i32 / i64 / u64 (out of
  u64 range -> plain path, which raises); exact bools -> u1; exact floats -> fp32; None ->
  constexpr None; host tensor descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`)
  -> their base's dtype, block shape and padding (Triton's launcher encodes the CUtensorMap from
  the descriptor on every launch, fast path included); for each constexpr parameter passed
  positionally, its exact value and type; every keyword argument by name, type and exact value (constexprs and options such as num_warps,
  num_stages; floats and numpy scalars by repr, so 0.0 and -0.0 differ as in Triton's string
  key); and
  `knobs.runtime.debug`, `knobs.compilation.instrumentation_mode` and the kernel's `debug` flag,
  which the plain path folds into its options.
- Anything else takes the plain path, uncached: a triton other than 3.6.x (the convention above
  was read from 3.6); a grid that is not a tuple of 1..3 entries;
  argument types outside the list above (tuples, device-side descriptors, JIT functions, numpy scalars,
  int subclasses, ...); a keyword argument naming a non-constexpr parameter; a kernel that is not
  a `JITFunction` (an `InterpretedFunction` made under TRITON_INTERPRET=1, an autotuner, ...);
  TRITON_INTERPRET set (env or `knobs.runtime.interpret`); a launch hook registered in
  `triton.knobs.runtime` (launch_enter_hook / launch_exit_hook non-empty or not a HookChain); a
  pre-run hook on the kernel; a changed global the kernel depends on (the plain path raises); a
  non-CUDA or non-default Triton driver; a compiled kernel missing `run` / `function` /
  `packed_metadata`.
- The stream is the CURRENT torch stream of the current device, read on every launch with the same
  function Triton uses (`torch._C._cuda_getCurrentRawStream`). Nothing else is cached per call: no
  pointer, no grid, no scalar. So a launch issued during `torch.cuda.graph` capture (which runs on
  a side stream) is recorded into the graph exactly like the plain launch would be, and eager
  launches after capture go to whatever stream is current then. The fast path does no host sync
  and no allocation of its own (the compiled launcher still allocates Triton scratch, if any,
  exactly as on the plain path).
- `FastLauncher.bind(grid, *args, **kwargs)` is the one exception: it fixes the grid and the
  arguments once (CUDA tensors as their addresses) and returns a zero-argument launch, which
  holds the tensors alive. Its caller owns keeping them in place (no `set_`, no resize); the
  stream, the device and the plain-path conditions are still checked per call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import triton
from triton.runtime.driver import driver as _triton_driver
from triton.runtime.jit import JITFunction

__all__ = ["FastLauncher", "fast"]

# The launcher call convention above was read from triton 3.6 (jit.py, compiler.py and the NVIDIA
# driver's generated launcher); other versions always take the plain path.
_VERIFIED_TRITON = ("3.6.",)
ENABLED: bool = triton.__version__.startswith(_VERIFIED_TRITON)
try:
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain  # launch hooks live in HookChains (never None)
except ImportError:  # pragma: no cover - older triton
    _knobs = None
    _HookChain = None
    ENABLED = False

_Tensor = torch.Tensor
try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - triton without host tensor descriptors
    _TensorDescriptor = None

# Raw CUDA entry points, as Triton's GPUDriver uses them (absent from CPU builds of torch).
_get_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)
_get_raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# TRITON_INTERPRET is read on every launch; os.environ.get costs ~1-3 us, the underlying bytes
# dict ~50 ns. Only when the variable is present at all is Triton's own parsing consulted.
_ENV_DATA: dict | None = getattr(os.environ, "_data", None)
try:
    _INTERPRET_KEY: Any = os.environ.encodekey("TRITON_INTERPRET")  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - non-posix
    _ENV_DATA = None
    _INTERPRET_KEY = "TRITON_INTERPRET"


class _Unsupported(Exception):
    """An argument the key does not model: the launch takes the plain path."""


_PLAIN = object()  # cache entry: this key always takes the plain path
# keyword values keyed directly by (name, value) items plus their types; others by the slow key
_FAST_KW_TYPES = frozenset((int, bool, str, type(None)))


def _arg_code(a: Any) -> Any:
    """Key element of one positional argument of a non-constexpr parameter (see cache_key).

    FastLauncher.cache_key inlines this for speed; the two must stay identical (tested).
    """
    t = type(a)
    if t is _Tensor or (t is not bool and t is not int and t is not float and isinstance(a, _Tensor)):
        return (a.dtype, not a.data_ptr() & 15)
    if t is int:
        if a == 1:
            return 0
        if -2147483648 <= a <= 2147483647:
            return 2 + (not a & 15)
        if -9223372036854775808 <= a <= 9223372036854775807:
            return 4 + (not a & 15)
        if 0 <= a <= 18446744073709551615:
            return 6 + (not a & 15)
        raise _Unsupported("integer out of u64 range")
    if t is float:
        return 8
    if t is bool:
        return 9
    if a is None:
        return 10
    if t is _TensorDescriptor:
        return _desc_code(a)
    raise _Unsupported(f"argument type {t.__name__}")


def _desc_code(a: Any) -> tuple:
    """Key element of a host tensor descriptor: Triton specialises on its dtype and block shape;
    the padding is added (finer). Its address, shape and strides are launch arguments."""
    return ("desc", a.base.dtype, tuple(a.block_shape), a.padding)


def _globals_changed(fn: JITFunction) -> bool:
    """Mirror of JITFunction.run's check of the globals a compiled kernel depends on."""
    missing = object()
    for (name, _), (val, globals_dict) in fn.used_global_vals.items():
        if globals_dict.get(name, missing) != val:
            return True
    return False


def _driver_is_default_cuda() -> bool:
    """The fast path reproduces the default CUDA driver's device and stream lookups only."""
    try:
        active = _triton_driver.active
    except Exception:  # no usable driver (e.g. CPU-only machine)
        return False
    return (type(active).__name__ == "CudaDriver" and torch.version.hip is None
            and _get_device is not None and _get_raw_stream is not None
            and getattr(active, "get_current_stream", None) is _get_raw_stream
            and getattr(active, "get_current_device", None) is torch.cuda.current_device)


class FastLauncher:
    """Launches a Triton `JITFunction` like `fn[grid](...)`, skipping `JITFunction.run` on hits.

    See the module docstring for what the key covers and when the plain path is taken.
    Counters: `fast_launches` (direct launches of a cached CompiledKernel), `plain_launches`
    (launches through `fn[grid](...)`, misses included) and `misses` (new keys seen).
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.fast_launches = 0
        self.plain_launches = 0
        self.misses = 0
        self._cache: dict[tuple, Any] = {}
        # Only a real JITFunction is launched directly; anything else (InterpretedFunction made
        # under TRITON_INTERPRET=1, Autotuner, Heuristics, ...) always takes the plain path.
        self._supported = ENABLED and isinstance(fn, JITFunction) and type(fn).run is JITFunction.run
        params = list(getattr(fn, "params", ())) if self._supported else []
        self._params = params
        self._constexpr = tuple(bool(p.is_constexpr) for p in params)
        self._nonconst_names = frozenset(p.name for p in params if not p.is_constexpr)
        # positional arguments before the first constexpr parameter take the fast key path
        self._first_constexpr = next((i for i, c in enumerate(self._constexpr) if c), len(params))

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return partial(self._launch, grid)

    def reset(self) -> None:
        """Forget the cached kernels (and zero the counters)."""
        self._cache.clear()
        self.fast_launches = self.plain_launches = self.misses = 0

    def cache_key(self, args: Sequence[Any], kwargs: dict[str, Any], device: int = 0) -> tuple:
        """The launcher's key for these arguments on `device`; raises _Unsupported if unmodelled.

        Elements per positional argument of a non-constexpr parameter: tensors (dtype, aligned16);
        ints 0 (== 1), 2/3 (i32; 3 if % 16 == 0), 4/5 (i64), 6/7 (u64); float 8; bool 9; None 10;
        host tensor descriptors ("desc", dtype, block shape, padding).
        Positional constexpr parameters: (type, value). Keyword arguments: their (name, value)
        items and, separately, their types (True, 1 and 1.0 are equal as values).
        """
        n_args = len(args)
        if n_args > self._first_constexpr:
            return self._cache_key_slow(args, kwargs, device)
        parts: list[Any] = [device, n_args]
        append = parts.append
        for a in args:
            t = type(a)
            if t is _Tensor:
                append((a.dtype, not a.data_ptr() & 15))
            elif t is int:
                if a == 1:
                    append(0)
                elif -2147483648 <= a <= 2147483647:
                    append(2 + (not a & 15))
                elif -9223372036854775808 <= a <= 9223372036854775807:
                    append(4 + (not a & 15))
                elif 0 <= a <= 18446744073709551615:
                    append(6 + (not a & 15))
                else:
                    raise _Unsupported("integer out of u64 range")
            elif t is float:
                append(8)
            elif t is bool:
                append(9)
            elif a is None:
                append(10)
            elif t is _TensorDescriptor:
                append(_desc_code(a))
            elif isinstance(a, _Tensor):
                append((a.dtype, not a.data_ptr() & 15))
            else:
                raise _Unsupported(f"argument type {t.__name__}")
        if kwargs:
            types = tuple(map(type, kwargs.values()))
            if not _FAST_KW_TYPES.issuperset(types) or not self._nonconst_names.isdisjoint(kwargs):
                return self._cache_key_slow(args, kwargs, device)
            append(tuple(kwargs.items()))
            append(types)
        fn = self.fn
        append(_knobs.runtime.debug)
        append(_knobs.compilation.instrumentation_mode)
        append(fn.debug)
        return tuple(parts)

    def _cache_key_slow(self, args: Sequence[Any], kwargs: dict[str, Any], device: int) -> tuple:
        """The key for positional constexprs and keyword values other than int/bool/str/None."""
        cflags = self._constexpr
        if len(args) > len(cflags):
            raise _Unsupported("too many positional arguments")
        parts: list[Any] = ["slow", device, len(args)]
        for a, is_constexpr in zip(args, cflags):
            if is_constexpr:
                t = type(a)
                parts.append((t, repr(a) if isinstance(a, float) or t.__module__ == "numpy" else a))
            else:
                parts.append(_arg_code(a))
        for k, v in kwargs.items():
            if k in self._nonconst_names:
                raise _Unsupported(f"non-constexpr parameter {k!r} passed by keyword")
            t = type(v)
            # by repr where equal values compile differently (0.0 vs -0.0 in Triton's string key)
            parts.append((k, t, repr(v) if isinstance(v, float) or t.__module__ == "numpy" else v))
        parts += [_knobs.runtime.debug, _knobs.compilation.instrumentation_mode, self.fn.debug]
        return tuple(parts)

    def launch(self, grid: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """`fn[grid](*args, **kwargs)`; returns the CompiledKernel like the plain path."""
        return self._launch(grid, *args, **kwargs)

    def _needs_plain(self) -> bool:
        """True while something the fast path does not model is active (hooks, interpreter, ...)."""
        fn = self.fn
        rt = _knobs.runtime
        hook, exit_hook = rt.launch_enter_hook, rt.launch_exit_hook
        return bool((hook is not None and (type(hook) is not _HookChain or hook.calls))
                    or (exit_hook is not None and (type(exit_hook) is not _HookChain or exit_hook.calls))
                    or ((_ENV_DATA is None or _ENV_DATA.get(_INTERPRET_KEY) is not None
                         or "interpret" in rt.__dict__) and rt.interpret)
                    or fn.pre_run_hooks or (fn.used_global_vals and _globals_changed(fn)))

    def bind(self, grid: Any, *args: Any, resolve_pointers: bool = True, **kwargs: Any) -> Callable[[], Any]:
        """A zero-argument launch of `fn[grid](*args, **kwargs)` with the key looked up once.

        Unlike `launcher[grid](...)`, the arguments are fixed here: the caller keeps every tensor
        passed in place for as long as it calls the result (the result holds them alive). The
        stream is still read on each call, and every call re-checks what `_needs_plain` covers.
        Where the fast path does not apply, or no launch with this key has happened yet, the
        result takes the `[grid]` path on every call (same kernels, same results).
        With `resolve_pointers`, each CUDA tensor's address is read here, once: Triton's C
        launcher takes an int as the pointer itself, where for a tensor it calls `data_ptr()`
        and asks the driver (`cuPointerGetAttribute`) on every launch.
        """
        def generic() -> Any:
            return self._launch(grid, *args, **kwargs)

        if not self._supported or type(grid) is not tuple or not 1 <= len(grid) <= 3:
            return generic
        try:
            dev = _get_device()  # type: ignore[misc]
            entry = self._cache.get(self.cache_key(args, kwargs, dev))
        except (_Unsupported, TypeError):
            return generic
        if entry is None or entry is _PLAIN:
            return generic
        run, pre, tail, compiled = entry
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        fixed = tuple(_device_address(a) for a in args) if resolve_pointers else args
        rest = (*pre, *fixed, *tail)

        def bound() -> Any:
            if self._needs_plain() or _get_device() != dev:  # type: ignore[misc]
                return self._plain(grid, args, kwargs)  # also what keeps args' tensors alive
            self.fast_launches += 1
            run(g0, g1, g2, _get_raw_stream(dev), *rest)  # type: ignore[misc]
            return compiled

        bound.fast = _Fast(self, dev, run, (g0, g1, g2), rest)  # type: ignore[attr-defined]
        return bound

    def _launch(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = self._launch_now(grid, args, kwargs)
        if _RECORDING is not None:
            _RECORDING.append(self.bind(grid, *args, **kwargs))
        return compiled

    def _launch_now(self, grid: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self._supported or type(grid) is not tuple or not 1 <= len(grid) <= 3:
            return self._plain(grid, args, kwargs)
        if self._needs_plain():
            return self._plain(grid, args, kwargs)
        try:
            dev = _get_device()  # type: ignore[misc]
            key = self.cache_key(args, kwargs, dev)
            entry = self._cache.get(key)
        except (_Unsupported, TypeError):  # TypeError: no CUDA build, or an unhashable value
            return self._plain(grid, args, kwargs)
        if entry is None:
            self.misses += 1
            compiled = self._plain(grid, args, kwargs)
            self._cache[key] = self._make_entry(compiled, args, kwargs)
            return compiled
        if entry is _PLAIN:
            return self._plain(grid, args, kwargs)
        run, pre, tail, compiled = entry
        n = len(grid)
        self.fast_launches += 1
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_raw_stream(dev),  # type: ignore[misc]
            *pre, *args, *tail)
        return compiled

    def _plain(self, grid: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        self.plain_launches += 1
        return self.fn[grid](*args, **kwargs)

    def _make_entry(self, compiled: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """(run, pre, tail args, compiled), or _PLAIN if not launchable: a launch is
        `run(grid_0, grid_1, grid_2, stream, *pre, *args, *tail)`. run is the compiled
        launcher's C `launch` where the kernel needs no scratch memory (`_direct`), else the
        CudaLauncher itself (pre: function, packed metadata, no launch metadata, no hooks)."""
        if compiled is None or not _driver_is_default_cuda():
            return _PLAIN
        try:
            run = compiled.run  # the CudaLauncher (initialised by the plain launch)
            function = compiled.function
            packed = compiled.packed_metadata
        except Exception:
            return _PLAIN
        if not callable(run) or function is None or packed is None:
            return _PLAIN
        tail = []
        for p in self._params[len(args):]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])  # a constexpr: its value is part of the key
            elif p.has_default:
                tail.append(p.default)
            else:
                return _PLAIN  # the plain path would have failed to bind
        direct = _direct(run)
        if direct is not None:
            launch, coop, pdl = direct
            return (launch, (function, coop, pdl, None, None, packed, None, None, None), tuple(tail), compiled)
        return (run, (function, packed, None, None, None), tuple(tail), compiled)


def _direct(run: Any) -> tuple[Callable[..., Any], Any, Any] | None:
    """(launch, cooperative, pdl) to call the C launch of a CudaLauncher (Triton 3.6,
    `backends/nvidia/driver.py`) directly, as its `__call__` does after allocating scratch:
    `launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    packed, launch_metadata, enter_hook, exit_hook, *args)`. None where the kernel needs
    global or profile scratch (only `__call__` allocates it) or the launcher is another kind."""
    try:
        launch = run.launch
        scratch = (run.global_scratch_size, run.profile_scratch_size)
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:
        return None
    if not callable(launch) or any(scratch):
        return None
    return launch, coop, pdl


@dataclass(frozen=True)
class _Fast:
    """What a bound launch's fast path calls, for `batched` to call it without the per-launch
    checks: `run(*grid, stream, *rest)` (see `_make_entry`)."""

    launcher: FastLauncher
    dev: int
    run: Callable[..., Any]
    grid: tuple[int, int, int]
    rest: tuple


def _run_fast(run: Callable[..., Any], grid: tuple[int, int, int], rest: tuple, stream: int) -> None:
    run(grid[0], grid[1], grid[2], stream, *rest)


def _call(call: Callable[[], Any], _stream: int) -> None:
    call()


def batched(calls: Sequence[Callable[[], Any]]) -> Callable[[], None]:
    """One zero-argument replay of `calls` in order, as `for c in calls: c()` does.

    The bound launches among them (from `FastLauncher.bind`, fast path ready) share one check of
    what each bound launch checks per call: the current device, each launcher's plain-path
    conditions (`_needs_plain`), then one read of the current stream. Where a check fails, the
    whole replay takes the per-call path. Other calls (torch ops, graph replays, bound launches
    without a fast path) run as they are, in their place; none may switch the current stream
    or device (the engine's recorded steps do not).
    """
    calls = list(calls)
    fasts = [getattr(c, "fast", None) for c in calls]
    devs = {f.dev for f in fasts if f is not None}
    if len(devs) != 1:

        def each() -> None:
            for c in calls:
                c()

        return each
    dev = devs.pop()
    entries = [partial(_call, c) if f is None else partial(_run_fast, f.run, f.grid, f.rest)
               for c, f in zip(calls, fasts)]
    counts: dict[FastLauncher, int] = {}
    for f in fasts:
        if f is not None:
            counts[f.launcher] = counts.get(f.launcher, 0) + 1
    tally = tuple(counts.items())  # each launcher once, with its launches per replay

    def replay() -> None:
        if _get_device() != dev or any(la._needs_plain() for la, _ in tally):  # type: ignore[misc]
            for c in calls:
                c()
            return
        stream = _get_raw_stream(dev)  # type: ignore[misc]
        for e in entries:
            e(stream)
        for la, n in tally:
            la.fast_launches += n

    return replay


def _device_address(a: Any) -> Any:
    """A CUDA tensor's address as an int (what the C launcher reads from a tensor); else `a`.
    Only CUDA tensors: a CPU tensor keeps the launcher's own error."""
    return a.data_ptr() if isinstance(a, _Tensor) and _on_device(a) else a


def _on_device(t: Any) -> bool:
    return t.is_cuda


_LAUNCHERS: dict[int, tuple[Any, FastLauncher]] = {}

# While set (by `recording`), every FastLauncher launch also appends its bound form here.
_RECORDING: list[Callable[[], Any]] | None = None


@contextmanager
def recording(calls: list[Callable[[], Any]]) -> Iterator[None]:
    """Append `launcher.bind(...)` of every FastLauncher launch made inside to `calls` (after
    the launch itself, which runs as usual). Process-wide: launches from any thread are taken,
    so the caller must be the only one launching meanwhile (the engine's step loop is). Not
    reentrant."""
    global _RECORDING
    if _RECORDING is not None:
        raise RuntimeError("launch recording is already active")
    _RECORDING = calls
    try:
        yield
    finally:
        _RECORDING = None


def fast(fn: Any) -> FastLauncher:
    """The process-wide FastLauncher of `fn` (created on first use); `fast(k)[grid](...)`."""
    hit = _LAUNCHERS.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    launcher = FastLauncher(fn)
    _LAUNCHERS[id(fn)] = (fn, launcher)  # holds fn, so its id stays unique
    return launcher
