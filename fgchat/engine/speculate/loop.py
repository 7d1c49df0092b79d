"""Speculative decoding in the engine: a mixin of `Engine` (engine.core) holding the method, the
draft length and the proposers, and running a speculative step where one pays.

A speculative step: each running request asks its adaptive controller for k drafts, the
proposer offers up to k, the target verifies the last token and the drafts in one step over
B x (K + 1) rows, K the configured draft length (speculate.verify.block_rows pads shorter drafts;
step.StepProgram.pieces) in the engine's mode, each request accepts its own prefix
(speculate.accept) and emits the accepted drafts and the target's token after them. Its
TokenEvents carry the mode that ran and the graph ("full/b1k4": batch 1, blocks of 4 drafts). A
step where nothing is proposed runs as a plain decode step instead; requests with penalties
decode plainly (their counts change token by token). The oracle verifies K drafts every step
(no adaptive length, no pause): it measures the verification step itself.

Invariants:
- one verification shape per (mode, batch size, variant) at a given K, whatever the drafts'
  lengths: the graphs are captured while idle (`_spec_capture_next`, after the decode graphs) or
  with `capture_sizes`, so a request's speculative steps replay graphs captured before it (one
  taken on first use remains the fallback, announced like a decode graph's; mega's verification
  runs in full);
- the draft model proposes in the mode the verification runs in (speculate.draft_steps: its graphs
  captured on first use into the target's pool, announced as the target's are: its captures join
  EngineInfo.captures as kind "draft ...", a failed capture is a note and the draft runs
  eagerly)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from fgchat.engine.speculate import check_draft_len, check_method
from fgchat.engine.speculate.accept import (STREAM_ACCEPT, STREAM_RESIDUAL, accept, greedy_prefix, row_uniforms,
                                            target_probs)
from fgchat.engine.speculate.adaptive import AdaptiveK
from fgchat.engine.speculate.payoff import PAUSED, SPECULATE, SpecPayoff
from fgchat.engine.speculate.proposers import Oracle, ngram_propose
from fgchat.engine.speculate.verify import block_rows
from fgchat.engine.kv_cache import NUM_SLOTS
from fgchat.engine.modes import GRAPH_MODES
from fgchat.engine.step import Variant
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import CaptureReport, Mode

if TYPE_CHECKING:
    from fgchat.engine.requests import Sequence
    from fgchat.engine.speculate.draft import DraftModel


class SpecLoop:
    """The engine's speculation state, its live switch and the speculative step."""

    config: Any
    device: torch.device
    dtype: torch.dtype
    max_context: int
    scheduler: Any
    decoder: Any
    cache: Any
    bufs: Any
    program: Any
    modes: Any
    mode: Mode
    model: Any
    tuning: Any
    notes: list[str]
    attention_name: str
    _info_due: bool

    def _init_speculation(self) -> None:
        self.spec_method = "off"
        self.spec_draft_len = check_draft_len(self.config.draft_len)
        self.spec_draft_name = ""
        # recorded continuations for `oracle`: every request that ends by stop or length records
        # its output, so a second run of the same prompt is drafted by the first
        self.spec_oracle = Oracle()
        self._draft: DraftModel | None = None
        self._draft_captures = 0  # the draft's captures EngineInfo has announced
        self.spec_payoff = SpecPayoff()  # whether speculation pays, per (mode, batch size)
        self.set_speculation(self.config.speculate)

    def set_speculation(self, method: str, draft_len: int | None = None) -> None:
        """Switch speculation for the next decode steps; `draft_len` None keeps the current one.
        The draft model loads on the first switch to `draft`."""
        check_method(method)
        if draft_len is not None:
            self.spec_draft_len = check_draft_len(draft_len)
        if method == "draft" and self._draft is None:
            self._draft = self._load_draft()
            self.spec_draft_name = self._draft.name
        self.spec_method = method
        self.spec_payoff.reset_speculation()  # its cost was another method's or draft length's
        for seq in self.scheduler.every():
            seq.spec = None  # a fresh controller at the new draft length

    def _load_draft(self) -> DraftModel:
        from fgchat.engine.speculate.draft import DraftModel, check_compatible, load_draft

        if not self.config.draft:
            raise FgchatError("speculation by a draft model needs --draft MODEL")
        loaded = load_draft(self.config.draft, self.device, self.dtype, self.config.seed)
        check_compatible(self.model, loaded)
        return DraftModel(loaded, self.max_context, self.decoder.fused, self.tuning, self.attention_name,
                          self._draft_note, self.modes)

    def _draft_note(self, text: str) -> None:
        self.notes.append(f"draft model: {text}")
        self._info_due = True

    def _spec_captures(self) -> list[CaptureReport]:
        """The draft model's graph captures (EngineInfo.captures lists them after the target's)."""
        return self._draft.steps.reports() if self._draft is not None else []

    # ---- the step ----
    def _spec_wanted(self, seqs: list[Sequence]) -> bool:
        """Whether this step speculates: on, no lane penalized, speculation paying at this batch
        size (speculate.payoff) and some lane not paused (paused lanes count a plain step as one
        of their pause)."""
        if self.spec_method == "off" or not seqs or any(s.params.penalized for s in seqs):
            return False
        if self.spec_method == "oracle":
            return True  # the oracle measures the verification step: never paused
        states = [self._controller(s) for s in seqs]
        verdict = self.spec_payoff.verdict(self.mode, len(seqs))
        if verdict != SPECULATE or all(st.paused for st in states):
            for st in states:
                st.tick()
                st.cost_paused += verdict == PAUSED
            return False
        return True

    def _spec_plain_step(self, mode: Mode, b: int, ms: float) -> None:
        """A plain decode step's cost (decode_loop._collect): plain's side of the payoff."""
        self.spec_payoff.plain_step(mode, b, ms)

    def _controller(self, seq: Sequence) -> AdaptiveK:
        if seq.spec is None:
            seq.spec = AdaptiveK(self.spec_draft_len)
        return seq.spec  # type: ignore[return-value]

    def _want(self, seq: Sequence) -> int:
        """Drafts a request asks for this step: K for the oracle, else its controller's k."""
        st = self._controller(seq)
        return st.k_max if self.spec_method == "oracle" else st.want()

    def _room(self, seq: Sequence) -> int:
        """Drafts the request can take: its output budget after the target's own token, and the
        cache rows the verification writes (positions length - 1 .. length - 1 + k)."""
        return max(0, min(seq.params.max_tokens - len(seq.output_ids) - 1, self.max_context - seq.length - 1))

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        if self.spec_method == "draft" and self._draft is not None:
            out = self._draft.propose(seqs, ks, self.modes.verify_mode(self.mode))
            n = self._draft.steps.modes.capture_count()
            if n != self._draft_captures:
                self._draft_captures, self._info_due = n, True  # step() sends EngineInfo
            return out
        if self.spec_method == "oracle":
            return [self.spec_oracle.propose(s.prompt_ids, s.output_ids, k) for s, k in zip(seqs, ks)], [None] * len(seqs)
        return [ngram_propose(s.prompt_ids + s.output_ids, k) for s, k in zip(seqs, ks)], [None] * len(seqs)

    def _spec_step(self) -> bool:
        """One speculative step over the running batch; False when nothing was proposed (the
        caller runs a plain step then)."""
        self._drain()  # type: ignore[attr-defined]  # the last tokens are the proposers' input
        seqs = list(self.scheduler.running)
        if not seqs:
            return True
        ks = [min(self._want(s), self._room(s)) for s in seqs]
        cuda = self.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        mode, captures = self.mode, self._capture_total()
        t0 = self.clock()  # type: ignore[attr-defined]
        drafts, qs = self._propose(seqs, ks)
        drafts = [d[:k] for d, k in zip(drafts, ks)]
        if not any(drafts):
            for s, k in zip(seqs, ks):
                self._controller(s).update(0, 0) if k else self._controller(s).tick()
            return False
        best, logits, ran, block = self._verify(seqs, drafts)
        results = [self._accept(s, best[i * block: i * block + len(d) + 1], logits, i * block, d, q)
                   for i, (s, d, q) in enumerate(zip(seqs, drafts, qs))]
        launch_ms = (self.clock() - t0) * 1e3  # type: ignore[attr-defined]
        graph = None if ran == Mode.EAGER else f"{ran}/b{len(seqs)}k{block - 1}"
        gpu_ms = None
        if cuda:
            end.record()
            end.synchronize()
            gpu_ms = start.elapsed_time(end)
        b = len(seqs)
        running = self.scheduler.running
        emitted = 0
        for seq, d, (m, tok), k in zip(seqs, drafts, results, ks):
            n_before = seq.length
            if k or d:
                self._controller(seq).update(len(d), m)
            else:
                self._controller(seq).tick()
            fields = dict(step_id=seq.decode_steps, draft_len=len(d), accepted_in_step=m,
                          spec_method=self.spec_method)
            seq.decode_steps += 1  # before the tokens: the last one may end the request
            for j, t in enumerate(d[:m] + [tok]):
                if not any(seq is r for r in running):
                    break  # stopped on an earlier token of this step
                self._emit(seq, t, ran, b, gpu_ms, graph, launch_ms,  # type: ignore[attr-defined]
                           spec=dict(fields, drafted=j < m))
                emitted += 1
            if self._draft is not None and self.spec_method == "draft":
                self._draft.settle(seq, n_before, len(d), m)
        if self.mode == mode and self._capture_total() == captures:  # a capture's time is no step's cost
            self.spec_payoff.spec_step(mode, b, max(launch_ms, gpu_ms or 0.0), emitted / b)
        return True

    # ---- the verification graphs, before any request needs them ----
    def _spec_graph_mode(self, mode: Mode) -> Mode | None:
        """The graph mode the verification runs in when the engine runs `mode`; None where it runs
        eager or speculation is off."""
        if self.spec_method == "off":
            return None
        mode = self.modes.verify_mode(mode)
        return mode if mode in GRAPH_MODES and not self.modes.unavailable.get(mode) else None

    def _spec_shapes(self, mode: Mode, sizes: Iterable[int]) -> list[tuple[Mode, int, Variant, int]]:
        """The verification shapes of `sizes` at block K + 1 (greedy, then sampled) that `mode`'s
        verification lacks."""
        vmode = self._spec_graph_mode(mode)
        if vmode is None:
            return []
        runner, block = self.modes.modes[vmode], self.spec_draft_len + 1
        return [(vmode, b, v, block) for v in (Variant.GREEDY, Variant.SAMPLED) for b in sizes
                if not runner.has(b, v, block)]

    def _spec_capture_next(self) -> bool:
        """While idle (Engine.capture_idle, after the decode graphs): the next verification graph
        the engine's mode lacks, batch sizes 1..NUM_SLOTS; False when none is left. A failed
        capture disables the mode, as one on first use does."""
        shapes = self._spec_shapes(self.mode, range(1, NUM_SLOTS + 1))
        if shapes:
            self.modes.prepare(*shapes[0])
        return bool(shapes)

    def _spec_capture_sizes(self, mode: Mode, sizes: Iterable[int]) -> None:
        """Engine.capture_sizes: the verification graphs of these batch sizes in `mode`."""
        for shape in self._spec_shapes(mode, sizes):
            if self.modes.prepare(*shape):
                return  # failed: the mode is disabled

    def _capture_total(self) -> int:
        return self.modes.capture_count() + (self._draft.steps.modes.capture_count() if self._draft else 0)

    def _verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list[int], torch.Tensor, Mode, int]:
        """The verification step in the engine's mode: (each row's pick, the logits of every row
        [rows, V], the mode that ran, block)."""
        ids, pos, slots, block = block_rows([s.output_ids[-1] for s in seqs], drafts, [s.length for s in seqs],
                                            [s.slot for s in seqs], self.max_context, self.spec_draft_len + 1)
        n, b = len(ids), len(seqs)
        variant = Variant.SAMPLED if any(s.params.temperature > 0 for s in seqs) else Variant.GREEDY
        self.bufs.stage(ids, pos, slots, [0.0] * n, [1.0] * n, [0] * n, [0] * n)
        self.program.max_len_hint = max(pos) + 1
        mode = self._prepared_mode(self.modes.verify_mode(self.mode), b, variant, block)  # type: ignore[attr-defined]
        out, ran = self.modes.run(mode, b, variant, block)
        return out.tokens[:n].tolist(), out.logits, ran, block

    def _accept(self, seq: Sequence, best: list[int], logits: torch.Tensor, first: int, drafts: list[int],
                q: torch.Tensor | None) -> tuple[int, int]:
        """(drafts accepted, the target's token after them) for one request whose rows start at
        `first` of the verification step's picks and logits (`best` holds its own rows' picks)."""
        p = seq.params
        if p.temperature <= 0:
            return greedy_prefix(best, drafts)
        rows = len(drafts) + 1
        logits = logits[first: first + rows].float()
        dev = logits.device
        probs = target_probs(logits, torch.full((rows,), p.temperature, device=dev),
                             torch.full((rows,), p.top_p, device=dev),
                             torch.full((rows,), p.top_k, dtype=torch.int64, device=dev))
        n = seq.length  # row r chooses the token at position n + r
        positions = list(range(n, n + rows))
        u = row_uniforms(p.seed, positions[:-1], STREAM_ACCEPT, 1, dev)[:, 0]
        residual_u = row_uniforms(p.seed, positions, STREAM_RESIDUAL, logits.shape[1], dev)
        d = torch.tensor(drafts, dtype=torch.int64, device=dev)
        m, tok = accept(probs[None], None if q is None else q[None].to(probs.dtype), d[None], u[None], residual_u[None])
        return int(m[0]), int(tok[0])

    # ---- the request's record ----
    def _spec_finished(self, seq: Sequence, reason: str) -> dict | None:
        """On a request's end: its output recorded for the oracle; its RequestSummary.spec."""
        if reason in ("stop", "length") and seq.params.temperature <= 0:
            self.spec_oracle.record(seq.prompt_ids, seq.output_ids)
        st = seq.spec
        if not isinstance(st, AdaptiveK):
            return None
        steps = max(seq.decode_steps, 1)
        return {
            "method": self.spec_method, "draft_len": st.k_max, "proposed": st.proposed, "accepted": st.accepted,
            "acceptance_rate": st.accepted / st.proposed if st.proposed else 0.0,
            "tokens_per_step": max(len(seq.output_ids) - 1, 0) / steps, "paused_for_cost": st.cost_paused,
        }
