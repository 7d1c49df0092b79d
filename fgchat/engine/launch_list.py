"""An eager decode step recorded once per batch size as a list of host launches, then replayed.

Eager mode launches every kernel of the step from the host. Run through the stages, each launch
also pays for the stage's Python, output allocation and the launcher's key over its arguments.
Those depend only on shapes, as for the graphs: the step reads its inputs from fixed-address
buffers (engine.step), the cache and the weights never move. So the first eager step at a batch
size is run under a recorder, and later steps at that size replay what it launched, in the same
order with the same arguments: same kernels, same bits, still one host launch per kernel.

Invariants:
- Everything the recorded step launched is in the list, or no list is made: Triton launches
  through FastLauncher (counted against a launch hook that sees every Triton launch), torch ops
  through a dispatch mode (in-place and `out=` ops replayed as called; a bias-free 2-D linear as
  mm into its recorded result, the kernel the functional call runs; other ops with tensor
  results re-run and copied into those results, so the same kernel produces the same bits;
  views of an input and allocations skipped). An op whose result or shape the data decides
  (host syncs such as item(), nonzero, masked_select) makes the step unrecordable, and eager
  keeps running it through the stages.
- The list holds every tensor its launches touch, so none is freed or reused while it exists:
  the recorded step's outputs and intermediates keep their addresses, as a graph's pool does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")

_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


@dataclass
class LaunchList(Generic[T]):
    """The recorded launches of one step and the result they write (the recorded step's own)."""

    calls: list[Callable[[], Any]]
    result: T
    _run: Callable[[], None] | None = field(default=None, init=False, repr=False)

    def replay(self) -> T:
        if self._run is None:
            self._run = replay_in_order(self.calls)
        self._run()
        return self.result


def replay_in_order(calls: list[Callable[[], Any]]) -> Callable[[], None]:
    """`for c in calls: c()` as one call; its bound Triton launches checked once per replay
    (`launch.batched`) where Triton is installed."""
    try:
        from fgchat.engine.kernels import launch
    except ImportError:  # no Triton: no Triton launch among the calls
        def each() -> None:
            for c in calls:
                c()

        return each
    return launch.batched(calls)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class _OpRecorder(TorchDispatchMode):
    """Appends a replayable form of each torch op to `calls`; sets `failed` on the first op it
    cannot replay exactly."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False keeps TorchDispatchMode from wrapping __torch_dispatch__ in torch._disable_dynamo,
        # whose first call imports torch._dynamo (1.6 s on a 2-vCPU VM with bytecode, ~5 s on a
        # GPU host without): that import would land on the first eager reply's step. A recording
        # never runs under torch.compile.
        return False

    def __init__(self, calls: list[Callable[[], Any]]) -> None:
        super().__init__()
        self.calls = calls
        self.failed = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.failed:
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func in _ALLOCATIONS:
            return
        tags = func.tags
        if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
            self.failed = f"{func} depends on the data (a host sync, or a shape the data decides)"
            return
        if func._schema.is_mutable:  # in-place and out= forms: the same call writes the same tensors
            self.calls.append(partial(func, *args, **kwargs))
            return
        if func.is_view and isinstance(out, torch.Tensor):
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            if out.untyped_storage().data_ptr() in inputs:
                return  # a view: reads what its input holds at the time
        if func is torch.ops.aten.linear.default and _bias_free(args, kwargs) and _plain_matrix(out):
            # linear without a bias is mm against the weight's transpose (what the functional call
            # runs): replayed straight into the recorded result, no copy
            self.calls.append(partial(torch.ops.aten.mm.out, args[0], args[1].t(), out=out))
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
            self.failed = f"{func} does not return tensors"
            return
        # the same op on the same inputs (same kernel, same bits), its results copied into the
        # recorded ones; an op's out= form may take another path (linear.out with a bias does)
        self.calls.append(partial(_into, tuple(outs), func, args, kwargs))


def _bias_free(args: tuple, kwargs: dict) -> bool:
    return len(args) == 2 and kwargs.get("bias") is None and all(isinstance(a, torch.Tensor) and a.dim() == 2
                                                                   for a in args)


def _plain_matrix(out: Any) -> bool:
    return isinstance(out, torch.Tensor) and out.dim() == 2 and out.is_contiguous()


def _into(outs: tuple[torch.Tensor, ...], func: Any, args: tuple, kwargs: dict) -> None:
    new = func(*args, **kwargs)
    for out, got in zip(outs, new if isinstance(new, (tuple, list)) else (new,)):
        out.copy_(got)


def record(step: Callable[[], T]) -> tuple[T, LaunchList[T] | None, str]:
    """Run `step` once, recording its launches. Returns (its result, the launch list or None,
    why there is none). The step's result is valid either way."""
    calls: list[Callable[[], Any]] = []
    ops = _OpRecorder(calls)
    with ExitStack() as stack:
        seen = _count_triton_launches(stack, calls)
        stack.enter_context(ops)
        result = step()
    if ops.failed:
        return result, None, ops.failed
    recorded = sum(1 for c in calls if not isinstance(c, partial))
    launched = seen[0] if seen is not None else 0
    if recorded != launched:
        return result, None, f"{launched} Triton launches, {recorded} through FastLauncher"
    return result, LaunchList(calls, result), ""


def _count_triton_launches(stack: ExitStack, calls: list[Callable[[], Any]]) -> list[int] | None:
    """Inside `stack`: FastLauncher launches recorded into `calls`, and a counter of every Triton
    launch (a launch hook; it also sends FastLauncher down Triton's own path, which calls hooks).
    None where Triton is not installed (then nothing can launch a Triton kernel)."""
    try:
        from triton import knobs

        from fgchat.engine.kernels import launch
    except ImportError:
        return None
    seen = [0]

    def count(*_: Any) -> None:
        seen[0] += 1

    knobs.runtime.launch_enter_hook.add(count)
    stack.callback(knobs.runtime.launch_enter_hook.remove, count)
    stack.enter_context(launch.recording(calls))
    return seen
