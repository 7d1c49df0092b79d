"""The engine's decode modes, one file each (eager.py, piecewise.py, full.py, mega.py; prefill graphs
beside full in prefill_graphs.py), held together by `ModeSet`.

`ModeSet.run(mode, B, sampled)` launches one step and returns what ran; the engine keeps its own
mode and learns of a fallback from that answer. Capture failures disable a mode with a reason;
eager always remains.

Invariants:
- a disabled mode never comes back; its graphs are dropped and their pool memory released;
- prefill graphs serve full mode only, so disabling full drops them too;
- a failed prefill capture leaves prefill eager (same bits) and full decode graphs in place;
- a captured mode passed its self-check: each batch size replayed at lengths unlike capture's
  gives eager's tokens and logits (mega, whose sums run in another order: its logits are as close
  to the float32 reference step as eager's, as_close_as_eager).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from fgchat.engine.kv_cache import NUM_SLOTS
from fgchat.engine.modes.base import StepMode
from fgchat.engine.modes.eager import EagerMode
from fgchat.engine.step import StepOutputs, StepProgram
from fgchat.protocol.events import CaptureReport, Mode

T = TypeVar("T")

GRAPH_MODES = (Mode.PIECEWISE, Mode.FULL, Mode.MEGA)


class ModeSet:
    def __init__(self, program: StepProgram, note: Callable[[str], None], share: ModeSet | None = None,
                 decode_only: bool = False) -> None:
        """`share`: another ModeSet whose graph pool and capture streams this one's graphs use
        (GraphCapture). decode_only: the decode and verification steps alone (a draft model's),
        no prefill graphs and no mega."""
        self.program = program
        self.note = note
        dec = program.dec
        cuda = program.bufs.device.type == "cuda"
        self.eager = EagerMode(program, cuda and dec.fused, note)
        self.modes: dict[Mode, StepMode] = {Mode.EAGER: self.eager}
        self.unavailable: dict[Mode, str] = {Mode.EAGER: ""}
        self.prefill_graphs = None  # PrefillGraphs in full mode (fused decoders on CUDA)
        self.kernel_warmup_s: float | None = None
        self.cap = None
        # captures deferred by capture_start, taken by capture_next: (mode or "prefill", size)
        self._queue: list[tuple[str, int]] = []
        self._self_check = False
        # prefill captures the decode graphs already account for
        self._prefill_seen = 0
        # (mode, batch size) whose decode graphs were captured before the latest prefill graph
        self._stale: list[tuple[Mode, int]] = []
        if not cuda:
            reason = "CUDA graphs need a CUDA device; this engine runs on CPU"
            self.unavailable.update({m: reason for m in GRAPH_MODES})
            return
        from fgchat.engine.modes.capture import GraphCapture
        from fgchat.engine.modes.full import FullMode
        from fgchat.engine.modes.piecewise import PiecewiseMode

        self.cap = GraphCapture(program, share.cap if share is not None else None)
        self.modes[Mode.PIECEWISE] = PiecewiseMode(self.cap)
        self.modes[Mode.FULL] = FullMode(self.cap)
        self.unavailable.update({m: "" for m in GRAPH_MODES})
        if decode_only:
            self.unavailable[Mode.MEGA] = "not built for this step program"
            return
        self._add_mega(dec.fused)
        if dec.fused:
            from fgchat.engine.modes.prefill_graphs import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(dec, program.cache.k, program.cache.v, self.cap)

    def _add_mega(self, fused: bool) -> None:
        if not fused:
            self.unavailable[Mode.MEGA] = "the mega kernel needs the fused (Triton) decoder"
            return
        from fgchat.engine.modes.mega import MegaMode

        try:
            self.modes[Mode.MEGA] = MegaMode(self.cap)
        except ValueError as exc:
            self.unavailable[Mode.MEGA] = str(exc)

    def install(self, mode: Mode, runner: StepMode) -> None:
        """Run `mode` with `runner` (tests: a mode without graphs)."""
        self.modes[mode] = runner
        self.unavailable[mode] = ""

    def capture_count(self) -> int:
        """How many captures `reports` holds (read every step: counts, builds no list)."""
        n = sum(len(self.modes[m].reports) for m in GRAPH_MODES if m in self.modes)
        return n + (len(self.prefill_graphs.reports) if self.prefill_graphs else 0)

    @property
    def reports(self) -> list[CaptureReport]:
        out = [r for m in GRAPH_MODES if m in self.modes for r in self.modes[m].reports]
        return out + (list(self.prefill_graphs.reports) if self.prefill_graphs else [])

    def capture_all(self, self_check: bool) -> None:
        """Warm the kernels, then capture prefill graphs and every batch size of each graph mode."""
        if self.cap is None:
            return
        self._warm()
        # prefill graphs first (H100, one run: 1B full decode 1.170 ms, 1.203 captured after)
        if self.prefill_graphs is not None:
            self._capture_prefill()
        for mode in GRAPH_MODES:
            # mega is captured on first use or while idle: its kernel's compile costs seconds
            if mode != Mode.MEGA and not self.unavailable.get(mode):
                self._capture_mode(mode, self_check)

    def capture_start(self, self_check: bool, first: Mode) -> None:
        """Warm the kernels and capture what a first request needs, `first` at batch size 1 (when
        it is a graph mode); queue every other capture for `capture_next`, which the engine runs
        while idle (uncaptured shapes are still captured on first use)."""
        if self.cap is None:
            return
        self._warm(range(1, 2))  # each deferred capture warms its own size first (GraphCapture.warmup)
        # mega last: its first capture compiles the largest kernel, which an arriving request waits for
        order = [first, *(m for m in GRAPH_MODES if m not in (first, Mode.MEGA))]
        sizes = [(m, b) for m in order if m in GRAPH_MODES for b in range(1, NUM_SLOTS + 1)]
        # the prefill buckets right after the first graph: a capture after a decode graph slows its
        # replays until it is captured again (decode_stale), so only that one is redone
        self._queue = sizes[:1]
        if self.prefill_graphs is not None:
            self._queue += [("prefill", n) for n in self.prefill_graphs.buckets]
        self._queue += sizes[1:]
        if first != Mode.MEGA:
            self._queue += [(Mode.MEGA, b) for b in range(1, NUM_SLOTS + 1)]
        self._self_check = self_check
        if first in GRAPH_MODES:
            self.capture_next()

    def capture_next(self) -> bool:
        """The next queued capture (with its self-check); False when none is left to do."""
        while self._queue:
            what, n = self._queue.pop(0)
            if what == "prefill":
                graphs = self.prefill_graphs
                if graphs is None or n in graphs.graphs:
                    continue
                try:
                    graphs.capture_idle(n)
                except (torch.OutOfMemoryError, RuntimeError) as exc:
                    self._drop_prefill_graphs(exc)
                return True
            mode = Mode(what)
            if self.unavailable.get(mode) or self.modes[mode].has(n, False):
                continue
            self.capture_sizes(mode, [n], self._self_check)
            return True
        return False

    def _warm(self, sizes: range = range(1, NUM_SLOTS + 1)) -> None:
        assert self.cap is not None
        try:
            self.kernel_warmup_s = self.cap.warm_kernels(sizes)
        except RuntimeError as exc:  # the captures meet the same failure and disable modes
            self.note(f"kernel warm-up failed: {str(exc).splitlines()[0][:160]}")

    def _capture_mode(self, mode: Mode, self_check: bool) -> None:
        self.capture_sizes(mode, range(1, NUM_SLOTS + 1), self_check)

    def decode_stale(self) -> bool:
        """A prefill graph was captured after decode graphs that are still held: those replay
        ~30 us a step slower from then on, until captured again (design.md V85; H100, SmolLM2 batch 2:
        +30.7 us after a batch-route capture, +4.2 us once the decode graphs were captured again).
        True while some are left to capture again."""
        graphs = self.prefill_graphs
        if graphs is not None and len(graphs.reports) > self._prefill_seen:
            self._prefill_seen = len(graphs.reports)
            held = [(m, b) for m in GRAPH_MODES
                    for b in sorted({b for b, _ in getattr(self.modes.get(m), "graphs", {})})]
            if held:  # every held size again, those already redone too: they preceded this capture
                self._stale = held
        return bool(self._stale)

    def recapture_decode(self) -> None:
        """The next stale (mode, batch size): its decode graphs (each variant held) captured again,
        its capture report replaced; one size per call, so an idle pass stays short (all of a
        mode's sizes at once took ~300 ms, SmolLM2 on an H100). A failure disables that mode as a
        first capture's would."""
        if not self._stale:
            return
        mode, b = self._stale.pop(0)
        runner = self.modes.get(mode)
        variants = sorted(v for size, v in getattr(runner, "graphs", {}) if size == b)
        if not variants or self.unavailable.get(mode):
            return
        for v in variants:
            del runner.graphs[(b, v)]  # its pool memory is free for the new capture
        runner.reports[:] = [r for r in runner.reports if r.batch_size != b or r.kind != "decode"]
        try:
            for v in variants:
                runner.capture(b, v)
        except torch.OutOfMemoryError:
            self.disable(mode, "out of GPU memory while capturing graphs")
        except RuntimeError as exc:
            self.disable(mode, f"graph capture failed: {str(exc).splitlines()[0][:160]}")

    def capture_sizes(self, mode: Mode, sizes: Iterable[int], self_check: bool) -> None:
        """Capture `mode` at each batch size (then self-check each); a failure disables the mode."""
        self.decode_stale()  # prefill captured before these decode graphs: no cost to them
        runner = self.modes[mode]
        try:
            for b in sizes:
                if not runner.has(b, False):
                    runner.capture(b, False)
                if self_check and not self.check_size(mode, b):
                    self.disable(mode, f"self-check mismatch at batch size {b}")
                    return
        except torch.OutOfMemoryError:
            self.disable(mode, "out of GPU memory while capturing graphs")
        except RuntimeError as exc:  # capture failures surface as RuntimeError
            self.disable(mode, f"graph capture failed: {str(exc).splitlines()[0][:160]}")

    def _capture_prefill(self) -> None:
        assert self.prefill_graphs is not None
        try:
            self.prefill_graphs.capture_all()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            self._drop_prefill_graphs(exc)

    def _drop_prefill_graphs(self, exc: Exception) -> None:
        """Prefill runs eagerly from now on (same bits); full decode graphs stay."""
        self.prefill_graphs = None
        torch.cuda.empty_cache()
        self.note(f"prefill graphs disabled: {str(exc).splitlines()[0][:160]}")

    def disable(self, mode: Mode, reason: str) -> None:
        self.unavailable[mode] = reason
        if mode == Mode.FULL:  # prefill graphs serve full mode only
            self.prefill_graphs = None
        self.modes[mode].drop()
        if self.cap is not None:
            torch.cuda.empty_cache()
        self.note(f"{mode} disabled: {reason}")

    def drop_all(self) -> None:
        for runner in self.modes.values():
            runner.drop()
        self.prefill_graphs = None

    def self_check(self, mode: Mode) -> None:
        """Every batch size of `mode` against eager (check_size); disables the mode at the first
        mismatch."""
        for b in range(1, NUM_SLOTS + 1):
            if not self.check_size(mode, b):
                self.disable(mode, f"self-check mismatch at batch size {b}")
                return

    @torch.inference_mode()
    def check_size(self, mode: Mode, b: int) -> bool:
        """Replay `mode`'s graph of batch size b at lengths unlike capture's (random, from a seed
        of b) and compare with eager: same tokens, finite logits close to eager's."""
        prog = self.program
        g = torch.Generator().manual_seed(1234 + b)
        top = max(prog.cache.max_context - 1, 2)
        pos = torch.randint(1, min(top, 4096), (b,), generator=g).tolist()
        ids = torch.randint(0, prog.dec.cfg.vocab_size, (b,), generator=g).tolist()
        if mode == Mode.MEGA:
            return self._check_against_reference(mode, ids, pos)
        prog.bufs.stage(ids, pos, list(range(b)), [0.0] * b, [1.0] * b, [0] * b, [0] * b)
        ref = prog.run_eager(b, False)
        ref_tokens, ref_logits = ref.tokens.clone(), ref.logits.clone()
        out = self.modes[mode].run(b, False)
        return torch.equal(out.tokens, ref_tokens) and bool(torch.isfinite(out.logits).all()) and (
            torch.allclose(out.logits, ref_logits, rtol=2e-2, atol=2e-2))

    def verify_mode(self, mode: Mode) -> Mode:
        """The mode a verification step runs in when the engine runs `mode`: `mode` itself, but
        for mega (its kernel decodes one row per sequence), whose verification runs full's graphs
        where full is available, else eagerly."""
        if mode != Mode.MEGA:
            return mode
        return Mode.FULL if not self.unavailable.get(Mode.FULL) and Mode.FULL in self.modes else Mode.EAGER

    def prepare(self, mode: Mode, b: int, variant: int, block: int = 1) -> str:
        """At a step boundary, before the step: `mode`'s graph of (b, variant) (of b x block rows,
        a verification step, where block > 1) captured where it has none (its report joins
        `reports`). "" when `mode` can run the step; otherwise why not, and `mode` is disabled (a
        capture that failed once is not retried at every step)."""
        runner = self.modes[mode]
        shape = (b, variant) if block == 1 else (b, variant, block)  # installed runners may take no block
        if runner.has(*shape):
            return ""
        try:
            runner.capture(*shape)
            return ""
        except torch.OutOfMemoryError:
            reason = "out of GPU memory while capturing graphs"
        except RuntimeError as exc:  # capture failures surface as RuntimeError
            reason = f"graph capture failed: {str(exc).splitlines()[0][:160]}"
        self.disable(mode, reason)
        self.program.max_len_hint = None
        return reason

    def run(self, mode: Mode, b: int, variant: int, block: int = 1) -> tuple[StepOutputs, Mode]:
        """One decode step in `mode` (prepared first); returns its outputs and the mode that ran
        it: eager where `mode` could not be prepared (see `prepare`)."""
        ran = Mode.EAGER if self.prepare(mode, b, variant, block) else mode
        shape = (b, variant) if block == 1 else (b, variant, block)
        return self.modes[ran].run(*shape), ran

    def prefill_logits(self, mode: Mode, ids: torch.Tensor, slot: int, greedy: bool = False) -> torch.Tensor:
        """Full mode replays a prefill graph (captured on first use of a bucket when capture is
        lazy); other modes, and prompts longer than the last bucket, prefill eagerly. Both run
        the same kernels at the same padded length. greedy: the logits serve an argmax only
        (model.prefill.head)."""
        graphs = self.prefill_graphs
        if mode == Mode.FULL and graphs is not None and graphs.covers(ids.shape[0]):
            out = self._graph_prefill(lambda: graphs.run(ids, slot, greedy))
            if out is not None:
                return out
        prog = self.program
        return prog.dec.prefill(ids, slot, prog.cache.k, prog.cache.v, greedy=greedy)

    def prefill_many_logits(self, mode: Mode, prompts: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor] | None:
        """Prompts admitted together [(ids [T_j], slot_j)] on the batch route (one padded batch;
        a graph per shape in full mode, the same kernels eagerly otherwise): each prompt's last
        logits [V]; None where the route does not apply (plain decoders, or these lengths)."""
        from fgchat.engine.model.prefill import batch_bucket, prefill_batch

        prog = self.program
        if not prog.dec.fused:
            return None
        tb = batch_bucket([int(p.shape[0]) for p, _ in prompts], prog.cache.max_context)
        if tb is None:
            return None
        graphs = self.prefill_graphs
        if mode == Mode.FULL and graphs is not None:
            out = self._graph_prefill(lambda: graphs.run_batch(prompts, tb))
            if out is not None:
                return out
        return prefill_batch(prog.dec, prompts, tb, prog.cache.k, prog.cache.v)

    def _graph_prefill(self, replay: Callable[[], T]) -> T | None:
        """A prefill graph's replay (captured first where new), or None when capturing failed:
        prefill graphs are then dropped and the caller prefills eagerly (same bits)."""
        try:
            return replay()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # a capture failure
            self._drop_prefill_graphs(exc)
            return None

    def _check_against_reference(self, mode: Mode, ids: list[int], pos: list[int]) -> bool:
        """`mode` and eager, each against the float32 reference step (model.reference), for rows
        whose context is their own token repeated up to their position (sink_context)."""
        from fgchat.engine.model.reference import reference_decode_step

        prog, dec, b = self.program, self.program.dec, len(ids)
        slots = list(range(b))
        sink_context(prog, ids, pos, slots)
        prog.bufs.stage(ids, pos, slots, [0.0] * b, [1.0] * b, [0] * b, [0] * b)
        eager = prog.run_eager(b, False).logits.float().clone()
        out = self.modes[mode].run(b, False).logits.float().clone()
        ref = reference_decode_step(dec.cfg, dec.w, ids, pos, slots, prog.cache.k, prog.cache.v,
                                    dec.cos, dec.sin, dec.scale)
        return as_close_as_eager(out, eager, ref, dec.dtype)


def sink_context(prog: StepProgram, ids: list[int], pos: list[int], slots: list[int]) -> None:
    """Each row's token decoded at position 0 of its slot, its K/V then copied to positions
    [1, pos): a context a real model attends to as it does to a sequence's first token. Over an
    unwritten cache (zero K/V) the real bf16 weights drift so far that eager itself is up to 90%
    off float32 (docs/design.md, V38), and no comparison can tell a bug from noise."""
    b = len(ids)
    prog.bufs.stage(ids, [0] * b, slots, [0.0] * b, [1.0] * b, [0] * b, [0] * b)
    prog.run_eager(b, False)
    kv = prog.cache.all
    for s, p in zip(slots, pos):
        kv[:, s, 1:p] = kv[:, s, :1]


def as_close_as_eager(out: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Per row of float32 logits [B, V]: `out` finite, its relative error against the reference
    at most twice the start-up check's bound or twice eager's own error, whichever is larger,
    and its token inside the reference's band wherever eager's is."""
    from fgchat.engine.startup_check import MAX_REL_ERR, compare

    bound = MAX_REL_ERR.get(dtype, 0.12)
    for r in range(ref.shape[0]):
        c = compare(out[r: r + 1], ref[r: r + 1], dtype)
        e = compare(eager[r: r + 1], ref[r: r + 1], dtype)
        if not c.finite or c.max_rel_err > 2 * max(bound, e.max_rel_err) or (e.top1_ok and not c.top1_ok):
            return False
    return True
