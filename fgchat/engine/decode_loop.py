"""The decode loop: launch a batched decode step in the current mode (behind the step in flight
when pipelined), collect its tokens, emit them as events and finish requests that stop or reach
their length. A mixin of `Engine` (engine.core), which holds the state it uses."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from fgchat.engine.kernels import sampling
from fgchat.engine.kv_cache import NUM_SLOTS
from fgchat.engine.requests import Sequence
from fgchat.engine.step import ROW_IDS, ROW_POS, StepOutputs, Variant
from fgchat.protocol.events import EngineEvent, Mode, ModeChanged, RequestFinished, RequestSummary, TokenEvent

if TYPE_CHECKING:
    from fgchat.engine.model.config import ModelConfig
    from fgchat.engine.modes import ModeSet
    from fgchat.engine.prefix_reuse import SlotHistory
    from fgchat.engine.scheduler import Scheduler
    from fgchat.engine.step import StepBuffers, StepProgram


def _now() -> int:
    return time.monotonic_ns()


@dataclass
class _InFlight:
    """A decode step enqueued on the device whose tokens are not read yet."""

    seqs: list[Sequence]
    out: StepOutputs
    mode: Mode
    graph: str | None
    events: tuple | None  # (start, end, tokens copied) on CUDA
    host_tokens: torch.Tensor | None  # pinned [B], filled by the async copy
    logits: torch.Tensor
    launch_ms: float  # host time to enqueue the step


class DecodeLoop:
    """Launches, collects and emits decode steps; finishes requests."""

    device: torch.device
    cfg: ModelConfig
    max_context: int
    bufs: StepBuffers
    program: StepProgram
    modes: ModeSet
    mode: Mode
    scheduler: Scheduler
    history: SlotHistory
    reuses_prefixes: bool
    _pending: list[EngineEvent]
    _info_due: bool
    _advance_on_device: bool
    _advance: Any
    _spec_finished: Any  # speculate.loop.SpecLoop
    _spec_plain_step: Any

    def _init_decode_loop(self, graphs_kept: int) -> None:
        """The loop's state: nothing in flight; on CUDA two sets of (start, end, tokens copied)
        events and pinned token buffers, alternating between the step in flight and the one
        launched behind it."""
        cuda = self.device.type == "cuda"
        # pipelined on CUDA (the next step launched before the one in flight is read); on CPU the
        # step runs on the host, so each is read before the next (tests may set it on CPU)
        self.pipelined = cuda
        # the host clock steps are timed with, in seconds (tests inject their own)
        self.clock: Callable[[], float] = time.perf_counter
        self.keep_logits = False  # keep every collected step's logits in step_logits (tests)
        self.step_logits: list[torch.Tensor] = []
        self.last_logits: torch.Tensor | None = None
        self._inflight: _InFlight | None = None
        self._flip = 0
        if cuda:
            self._event_sets = [
                tuple(torch.cuda.Event(enable_timing=i < 2) for i in range(3)) for _ in range(2)
            ]
            self._host_tokens = [
                torch.zeros(NUM_SLOTS, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        # which graph ran each recent decode step (tests and diagnostics; bounded)
        self.step_graphs: deque[str | None] = deque(maxlen=graphs_kept)

    def _can_follow(self, prev: _InFlight, seqs: list[Sequence]) -> bool:
        """A step may be launched behind `prev` when it runs the same lanes and no lane can hit a
        length limit with prev's token (so the speculative step never writes past the cache)."""
        if len(prev.seqs) != len(seqs) or any(a is not b for a, b in zip(prev.seqs, seqs)):
            return False
        return all(
            len(s.output_ids) + 1 < s.params.max_tokens and s.length + 1 < self.max_context
            for s in seqs
        )

    def _launch(self, seqs: list[Sequence], prev: _InFlight | None) -> _InFlight:
        """Enqueue one decode step. With `prev`, inputs are prev's tokens at prev's positions + 1,
        written on the device behind prev; otherwise they are staged from the host."""
        b = len(seqs)
        if prev is None:
            pos = [s.length - 1 for s in seqs]
            ps = [s.params for s in seqs]
            self.bufs.stage(
                [s.output_ids[-1] for s in seqs], pos, [s.slot for s in seqs],
                [p.temperature for p in ps], [p.top_p for p in ps], [p.top_k for p in ps],
                [p.seed for p in ps], [p.repetition_penalty for p in ps], [p.presence_penalty for p in ps],
                [p.frequency_penalty for p in ps],
            )
            self.program.max_len_hint = max(pos) + 1
        else:
            if not self._advance_on_device:  # else prev's advance kernel did this
                di = self.bufs.dev_i
                di[ROW_IDS, :b].copy_(prev.out.tokens)
                di[ROW_POS, :b].add_(1)
            self.program.max_len_hint = (self.program.max_len_hint or 0) + 1
        v = self.cfg.vocab_size
        sampled = [s.params for s in seqs if s.params.temperature > 0]
        variant = Variant.of(any(s.params.penalized for s in seqs), bool(sampled),
                             any(sampling.needs_filter(p.top_p, p.top_k, v) for p in sampled))
        mode = self._prepared_mode(self.mode, b, variant)
        cuda = self.device.type == "cuda"
        events = None
        if cuda:
            self._flip ^= 1
            events = self._event_sets[self._flip]
            events[0].record()
        t0 = self.clock()
        out, _ = self.modes.run(mode, b, variant)  # prepared: runs `mode`
        launch_ms = (self.clock() - t0) * 1e3
        graph = None if mode == Mode.EAGER else f"{mode}/b{b}"
        host_tokens = None
        if cuda:
            events[1].record()
            host_tokens = self._host_tokens[self._flip][:b]
            if self._advance_on_device:
                di = self.bufs.dev_i
                self._advance(out.tokens, di[ROW_IDS, :b], di[ROW_POS, :b], host_tokens)
            else:
                host_tokens.copy_(out.tokens, non_blocking=True)
            events[2].record()
        # a graph's logits buffer is rewritten by the step launched behind this one
        logits = out.logits.clone() if self.keep_logits else out.logits
        self.step_graphs.append(graph)
        return _InFlight(seqs, out, mode, graph, events, host_tokens, logits, launch_ms)

    def _prepared_mode(self, mode: Mode, b: int, variant: int, block: int = 1) -> Mode:
        """The mode that runs a step of batch size b (b x block rows: a verification step):
        `mode`, its graph captured before the step (and before its timing starts); where it cannot
        be, eager, and the engine's switch to eager is announced, never silent."""
        why = self.modes.prepare(mode, b, variant, block)
        if not why:
            return mode
        self.mode = Mode.EAGER
        shape = f"batch size {b}" if block == 1 else f"verification of batch size {b}, {block - 1} drafts"
        self._pending.append(ModeChanged(Mode.EAGER, f"{mode} could not run {shape} ({why}): running eager"))
        self._info_due = True
        return Mode.EAGER

    def _collect(self, inf: _InFlight) -> None:
        """Wait for an enqueued step and emit its tokens to the lanes still running."""
        if inf.events is not None:
            inf.events[2].synchronize()
            tokens = inf.host_tokens.tolist()
            gpu_ms = inf.events[0].elapsed_time(inf.events[1])
        else:
            tokens, gpu_ms = inf.out.tokens.tolist(), None
        self.last_logits = inf.logits
        if self.keep_logits:
            self.step_logits.append(inf.logits)
        running = self.scheduler.running
        b = len(inf.seqs)
        self._spec_plain_step(inf.mode, b, max(inf.launch_ms, gpu_ms or 0.0))
        for seq, tok in zip(inf.seqs, tokens):
            if any(seq is r for r in running):  # finished or cancelled lanes drop their token
                self._emit(seq, tok, inf.mode, b, gpu_ms, inf.graph, inf.launch_ms)

    def _drain(self) -> None:
        inf, self._inflight = self._inflight, None
        if inf is not None:
            self._collect(inf)

    def _emit(
        self, seq: Sequence, token: int, mode: Mode, b: int, gpu_ms: float | None, graph: str | None,
        launch_ms: float | None = None, spec: dict | None = None,
    ) -> None:
        """`spec`: a speculative step's TokenEvent fields (step_id, drafted, draft_len,
        accepted_in_step, spec_method); that step counts itself in seq.decode_steps. Else a plain
        step's token (or prefill's, step -1)."""
        now = _now()
        first = not seq.output_ids
        if spec is None:
            method = getattr(self, "spec_method", "off")
            spec = dict(step_id=-1 if first else seq.decode_steps, spec_method="" if method == "off" else method)
            seq.decode_steps += 0 if first else 1  # before _finish below reads it
        itl = None if first else (now - seq.token_times_ns[-1]) / 1e6
        seq.output_ids.append(token)
        seq.token_times_ns.append(now)
        if itl is not None:
            seq.itls_ms.append(itl)
        seq.mode_counts[mode] = seq.mode_counts.get(mode, 0) + 1
        text = seq.detok.push(token) if seq.detok is not None else ""
        seq.text_parts.append(text)
        self._pending.append(
            TokenEvent(
                request_id=seq.request_id, token_index=len(seq.output_ids) - 1, token_id=token,
                text=text, mode=mode, batch_size=b, t_ns=now, itl_ms=itl, gpu_step_ms=gpu_ms,
                is_first_token=first, position=len(seq.prompt_ids) + len(seq.output_ids) - 1,
                graph=graph, launch_ms=launch_ms, **spec,
            )
        )
        if token in seq.stop_ids:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.length >= self.max_context:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.slot >= 0 and self.reuses_prefixes:
            # rows [0, len) hold the prompt and the outputs fed back (a stopped reply's too: those
            # rows were written by steps already read; a step still in flight writes only later
            # rows, and admission drains it before any prefill)
            if reason in ("stop", "length", "cancelled"):
                self.history.record(seq.slot, seq.prompt_ids + seq.output_ids[:-1])
            else:
                self.history.forget(seq.slot)
        self.scheduler.release(seq)
        if seq.detok is not None:
            tail = seq.detok.flush()
            if tail:
                seq.text_parts.append(tail)
        now = _now()
        n = len(seq.output_ids)
        ttft = (seq.token_times_ns[0] - seq.submit_ns) / 1e6 if n else (now - seq.submit_ns) / 1e6
        e2e = ((seq.token_times_ns[-1] if n else now) - seq.submit_ns) / 1e6
        tpot = (seq.token_times_ns[-1] - seq.token_times_ns[0]) / 1e6 / (n - 1) if n > 1 else None
        self._pending.append(
            RequestFinished(
                RequestSummary(
                    request_id=seq.request_id, prompt_tokens=len(seq.prompt_ids), output_tokens=n,
                    cached_tokens=seq.cached_tokens,
                    ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, finish_reason=reason,  # type: ignore[arg-type]
                    text="".join(seq.text_parts), token_ids=list(seq.output_ids),
                    itl_ms=list(seq.itls_ms), mode_counts=dict(seq.mode_counts),
                    spec=self._spec_finished(seq, reason),
                )
            )
        )
