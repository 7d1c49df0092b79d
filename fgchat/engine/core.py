"""The engine: admission + prefill, batched decode steps in the selected mode, token events."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fgchat.engine.admission import share_prompts
from fgchat.engine.cpu_malloc import keep_freed_blocks, release_free_blocks
from fgchat.engine.kernels import sampling
from fgchat.engine.kv_cache import NUM_SLOTS, KVCache, choose_max_context
from fgchat.engine.loader import LoadedModel, load_model, load_random, pick_device, pick_dtype
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.modes import GRAPH_MODES, ModeSet
from fgchat.engine.prefix_reuse import SlotHistory
from fgchat.engine.process import one_line, startup_mark
from fgchat.engine.requests import Sequence
from fgchat.engine.scheduler import Scheduler
from fgchat.engine.step import ROW_IDS, ROW_POS, StepBuffers, StepOutputs, StepProgram, Variant
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.errors import FgchatError, RequestError
from fgchat.protocol.events import (
    EngineError,
    EngineEvent,
    EngineInfo,
    Mode,
    ModeChanged,
    RequestFinished,
    RequestSummary,
    SamplingParams,
    StartupCheck,
    TokenEvent,
)
from fgchat.protocol.tuning import Tuning


STEP_GRAPHS_KEPT = 4096


def _now() -> int:
    return time.monotonic_ns()


def _only_argmax(group: list[Sequence]) -> bool:
    """A prompt's last logits serve only an argmax: every request sharing it is greedy and
    unpenalized (then the prefill may take them from the LM head's int8 pick)."""
    return all(s.params.temperature <= 0 and not s.params.penalized for s in group)


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


class Engine:
    """Single-GPU (or CPU) engine. Not thread-safe: one caller drives step().

    The engine holds its decode modes (`self.modes`, engine.modes) and its current `mode`, which
    only set_mode and a step's own fallback (a capture out of memory) change.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.tuning = config.tuning if config.tuning is not None else Tuning.from_env()
        # CPU: glibc keeps freed blocks for the next prefill's tensors (engine.cpu_malloc); the
        # free pages go back to the OS once the engine is idle after a prefill (capture_idle)
        self._keeps_blocks = self.device.type == "cpu" and keep_freed_blocks()
        self._trim_due = False
        if loaded is None:
            if config.preset:
                loaded = load_random(config.preset, self.device, self.dtype, config.seed, config.outliers)
            else:
                loaded = load_model(config.model, self.device, self.dtype)
        self.model = loaded
        self.cfg = loaded.cfg
        self.tokenizer = loaded.tokenizer
        self.notes: list[str] = list(config.notes) + list(loaded.notes)
        self.max_context, why = choose_max_context(
            self.cfg, self.dtype, self.device, config.max_context, self._kv_budget()
        )
        self.notes.append(f"max context {self.max_context} tokens ({why})")
        self.cache = KVCache(self.cfg, self.max_context, self.device, self.dtype)
        startup_mark("engine: kv cache allocated")
        self.scheduler = Scheduler()
        self.history = SlotHistory(NUM_SLOTS)  # what each slot's rows hold (engine.prefix_reuse)
        self._settled = False  # the work after the deferred captures is done (capture_idle)
        self._build(self._use_fused())
        cuda = self.device.type == "cuda"
        # pipelined on CUDA (the next step launched before the one in flight is read); on CPU the
        # step runs on the host, so each is read before the next (tests may set it on CPU)
        self.pipelined = cuda
        self.keep_logits = False  # keep every collected step's logits in step_logits (tests)
        self.step_logits: list[torch.Tensor] = []
        self._inflight: _InFlight | None = None
        self._flip = 0
        # Two sets of (start, end, tokens copied) events and pinned token buffers, alternating
        # between the step in flight and the one launched behind it.
        if cuda:
            self._event_sets = [
                tuple(torch.cuda.Event(enable_timing=i < 2) for i in range(3)) for _ in range(2)
            ]
            self._host_tokens = [
                torch.zeros(NUM_SLOTS, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        self.last_logits: torch.Tensor | None = None
        self.mode = Mode.EAGER
        self._pending: list[EngineEvent] = []
        self._info_due = False  # a ModeChanged is pending: EngineInfo follows it from step()
        self._next_id = 1
        # which graph ran each recent decode step (tests and diagnostics; bounded)
        self.step_graphs: deque[str | None] = deque(maxlen=STEP_GRAPHS_KEPT)
        self._reports_sent = self.modes.capture_count()
        best = Mode.FULL if not self.modes.unavailable.get(Mode.FULL) else Mode.EAGER
        try:
            ev = self.set_mode(config.mode or best)
        except FgchatError as exc:
            ev = self.set_mode(best)
            self.notes.append(f"{exc}; running {ev.mode}")
        if ev.reason:
            self.notes.append(ev.reason)
        # test fault injection (FGCHAT_FAULT=slow-steps): each step takes 5 ms longer, so a small
        # model's reply lasts long enough for tests that act while it streams
        from fgchat.engine.startup_check import FAULT_ENV

        self._step_delay_s = 0.005 if os.environ.get(FAULT_ENV, "") == "slow-steps" else 0.0
        self.startup_check: StartupCheck | None = None
        # with idle capture the check waits until the engine is idle or a request comes, whichever
        # is first: it always runs before any request is admitted (submit runs it)
        self._check_pending = self._wants_startup_check()
        if not self.tuning.idle_capture:
            self.run_startup_check()

    # ---- setup ----
    def _build(self, fused: bool) -> None:
        """The decode path: decoder (fused Triton stages or plain torch ops), step program,
        attention backend, launch lists and graphs (captured here unless lazy)."""
        self.history.clear()  # kernel warm-up and captures below run steps on stale inputs
        self.decoder = Decoder(self.cfg, self.model.weights, self.max_context, fused, self.tuning)
        # a step's tokens feed the next step and reach the host through one kernel (fused.advance)
        self._advance_on_device = fused
        if self._advance_on_device:
            from fgchat.engine.kernels.fused import advance

            self._advance = advance
        self.bufs = StepBuffers(self.device, self.cfg.num_heads, self.cfg.head_dim, self.dtype)
        self.attention, self.attention_name = self._pick_attention(self.config.attention)
        entry_pdl = self.decoder.bind_attention(
            rope_in_attention=self.attention.rope_in_attention,
            attention_is_triton=self.attention_name == "triton",
        )
        self.attention.pdl_entry = entry_pdl and self.attention.pdl
        c = self.cfg
        self.attention_label = self.attention.label(self.dtype, c.num_heads, c.num_kv_heads, c.head_dim)
        self.program = StepProgram(self.decoder, self.cache, self.bufs, self.attention)
        self.modes = self._make_modes()
        startup_mark("engine: decode path set up")
        if self.config.lazy_capture:
            return
        if self.tuning.idle_capture:
            try:
                first = Mode(self.config.mode or Mode.FULL)
            except ValueError:  # set_mode reports it
                first = Mode.FULL
            self.modes.capture_start(self.config.self_check, first)
        else:
            self.modes.capture_all(self.config.self_check)
        startup_mark("engine: warmed and captured")

    def _make_modes(self) -> ModeSet:
        return ModeSet(self.program, self.tuning, self.notes.append)

    def use_plain_path(self) -> None:
        """Drop the fused path (its graphs and pools) and rebuild on plain torch ops; the mode
        stays where it was when the new graphs allow it. The KV cache and weights are kept."""
        mode = self.mode
        self.modes.drop_all()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._build(False)
        self.mode = mode if not self.modes.unavailable.get(mode) else Mode.EAGER

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.6)
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 8 * 2**30
        return int(avail * 0.25)

    def run_startup_check(self) -> bool:
        """Run the start-up check if it has not run yet (it may switch the engine to plain torch
        ops); True when it ran. The next step() sends an EngineInfo that carries the result."""
        if not self._check_pending:
            return False
        self._check_pending = False
        from fgchat.engine import startup_check

        self.startup_check = startup_check.run(self)
        self.history.clear()  # its steps may have written any slot
        if self.startup_check.message:
            self.notes.append(self.startup_check.message)
        self._info_due = True
        return True

    @property
    def startup_check_pending(self) -> bool:
        return self._check_pending

    def _wants_startup_check(self) -> bool:
        """On CUDA, and on CPU in a reduced dtype (float32 on CPU is the reference itself);
        always under FGCHAT_FAULT=startup-check (tests)."""
        from fgchat.engine.startup_check import FAULT_ENV

        if os.environ.get(FAULT_ENV, "") == "startup-check":
            return True
        return self.config.self_check and (self.device.type == "cuda" or self.dtype != torch.float32)

    def _use_fused(self) -> bool:
        if self.device.type != "cuda":
            return False
        import importlib.util

        return self.tuning.fused and importlib.util.find_spec("triton") is not None

    def _pick_attention(self, name: str):
        from fgchat.engine.kernels.attention import get_backend

        try:
            backend = get_backend(name, self.device, self.tuning)
        except FgchatError as exc:
            if name in ("auto", "torch"):
                raise
            self.notes.append(f"{exc}; falling back to auto")
            backend = get_backend("auto", self.device, self.tuning)
        return backend, backend.name

    # ---- public API ----
    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name=self.model.name,
            architecture=self.cfg.architecture,
            device=str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            max_context=self.max_context,
            num_layers=self.cfg.num_layers,
            attention_backend=self.attention_label,
            available_modes={str(m): why for m, why in self.modes.unavailable.items()},
            mode=self.mode,
            captures=self.modes.reports,
            notes=list(self.notes),
            kernel_warmup_s=self.modes.kernel_warmup_s,
            startup_check=self.startup_check,
            startup_check_pending=self._check_pending,
            sampling_defaults=SamplingParams.from_generation_config(self.model.generation_config),
            sampling_source="generation_config.json" if self.model.generation_config else "",
            cpu_step="eager" if self.device.type == "cpu" else "",
        )

    @property
    def stop_ids(self) -> frozenset[int]:
        ids = set(self.cfg.eos_ids)
        if self.tokenizer is not None:
            ids |= set(getattr(self.tokenizer, "eos_ids", ()))
        return frozenset(ids)

    def set_mode(self, mode: str) -> ModeChanged:
        """Select the mode for the next decode step; unavailable modes fall back to eager."""
        try:
            wanted = Mode(mode)
        except ValueError:
            raise FgchatError(f"unknown mode '{mode}' (choose {', '.join(Mode)})") from None
        reason = self.modes.unavailable.get(wanted, "")
        if reason:
            self.mode = Mode.EAGER
            ev = ModeChanged(Mode.EAGER, f"{wanted} unavailable: {reason}")
        else:
            self.mode = wanted
            ev = ModeChanged(self.mode)
        self._pending.append(ev)
        self._info_due = True
        return ev

    def capture_sizes(self, mode: str, sizes: list[int]) -> None:
        """Capture `mode` at these batch sizes now, with the start-up self-check, instead of on
        first use (a benchmark's timed rounds then hold no capture); a failure disables the mode
        as a first-use capture's would."""
        wanted = Mode(mode)
        if wanted in GRAPH_MODES and wanted in self.modes.modes and not self.modes.unavailable.get(wanted):
            self.modes.capture_sizes(wanted, sizes, self.config.self_check)
            self.history.clear()  # the self-check's steps write slots 0..b-1

    def capture_idle(self) -> bool:
        """While no request runs, one piece of work that start-up deferred (Tuning.idle_capture):
        the start-up check first, then one capture at a time; True when one ran. A mode whose
        capture or self-check failed is left for eager then (its ModeChanged comes out of the
        next step())."""
        if self.has_work():
            return False
        if self._trim_due:  # no event to report: the loop asks again, for the work below
            self._trim_due = False
            release_free_blocks()
        if self.run_startup_check():
            return True
        if not self.modes.capture_next():
            if self.modes.decode_stale():
                self.modes.recapture_decode()
                self.history.clear()  # the captures' warm-up steps write slots 0..b-1
                self._info_due = True
                return True
            return self._settle_after_deferred_work()
        self.history.clear()  # its warm-up, capture and self-check steps write slots 0..b-1
        if self.modes.unavailable.get(self.mode):
            self.set_mode(self.mode)
        return True

    def fail_all(self, message: str) -> list[EngineEvent]:
        """After a step that raised: every request the engine holds (running, prefilling,
        waiting) ends with `message`, the step in flight is dropped unread, and no slot keeps a
        history, so the engine takes new requests from a clean state. Raises where the device
        itself is broken (a CUDA error is sticky): the caller must stop then."""
        self._inflight = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        held = self.scheduler.every()
        for seq in held:
            self.scheduler.remove_waiting(seq)
        self._fail_group(held, message)
        self.history.clear()
        events, self._pending = self._pending, []
        return events

    def _settle_after_deferred_work(self) -> bool:
        """Once, when the deferred captures are done: the heap frozen again (engine.heap), so the
        objects the captures made stay out of the collector's full walks. True when it ran; never
        where nothing was deferred (no graph captures: CPU)."""
        if self._settled or self.modes.cap is None:
            return False
        self._settled = True
        from fgchat.engine.heap import freeze_heap

        freeze_heap()
        return True

    def submit(
        self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: int | None = None
    ) -> int:
        params = params or SamplingParams()
        params.validate()
        self.run_startup_check()  # before any request is admitted
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_context} "
                "(raise --max-context or shorten the prompt)"
            )
        if any(not (0 <= t < self.cfg.vocab_size) for t in prompt_ids):
            raise RequestError("prompt contains token ids outside the vocabulary")
        if request_id is not None and self.scheduler.find(request_id) is not None:
            raise RequestError(f"request id {request_id} is already in use")
        rid = request_id if request_id is not None else self._next_id
        self._next_id = max(self._next_id, rid) + 1
        stops = frozenset() if params.ignore_eos else self.stop_ids
        seq = Sequence(rid, list(prompt_ids), params, stops, _now())
        if self.tokenizer is not None:
            from fgchat.engine.model.tokenizer import IncrementalDetokenizer

            seq.detok = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(seq)
        return rid

    def cancel(self, request_id: int) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.remove_waiting(seq)
        self._finish(seq, "cancelled")
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def running_batch_size(self) -> int:
        return len(self.scheduler.running)

    @torch.inference_mode()
    def step(self) -> list[EngineEvent]:
        """Admit and prefill waiting requests, then run one decode step over the running batch.

        Pipelined (CUDA): when the batch is the one of the step still in flight, the next step is
        launched first, fed the in-flight step's tokens on the device, and the in-flight step is
        read afterwards, so host work overlaps GPU work. Its events then arrive one call later.
        Not pipelined (CPU): a call that emitted first tokens returns them without a decode step,
        which would run on the host before the call returns.
        """
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        started = False
        if self.scheduler.waiting and self.scheduler.free_slots:
            self._drain()  # host staging and prefill need the in-flight step's tokens
            started = self._admit()
            self._trim_due = self._trim_due or (started and self._keeps_blocks)
        if started and not self.pipelined:
            pass  # a host-run step would hold the first tokens back by a whole decode step: next call
        elif self.scheduler.running:
            seqs = list(self.scheduler.running)
            prev = self._inflight
            if prev is not None and self._can_follow(prev, seqs):
                self._inflight = self._launch(seqs, prev)
                self._collect(prev)
            else:
                self._drain()
                seqs = list(self.scheduler.running)
                if seqs:
                    self._inflight = self._launch(seqs, None)
                    if not self.pipelined:
                        self._drain()
        else:
            self._drain()
        reports = self.modes.capture_count()
        if reports != self._reports_sent or self._info_due:
            self._reports_sent, self._info_due = reports, False  # captures or modes changed
            self._pending.append(self.info())
        events, self._pending = self._pending, []
        return events

    def _admit(self) -> bool:
        """Prefill the newly admitted requests, each distinct prompt once (engine.admission),
        and start them with their first tokens; whether any was emitted."""
        pending: list[tuple[Sequence, torch.Tensor]] = []
        choose = self._choose_slot if self.reuses_prefixes else None
        for group, logits in self._prefill_groups(share_prompts(self.scheduler.admit(choose))):
            if logits is None:
                continue
            lead = group[0]
            self.cache.copy_prefix(lead.slot, [s.slot for s in group[1:]], len(lead.prompt_ids))
            for seq in group[1:]:  # their rows are the lead's: so is what its prefill skipped
                seq.cached_tokens = lead.cached_tokens
            pending += [(seq, logits) for seq in group]
        firsts = self._first_tokens(pending)
        # First tokens of one admission round are read with one sync and emitted together, so
        # a request's decode latencies never include the prefills of requests admitted with it.
        if firsts:
            ids = torch.cat([tok for _, tok in firsts]).tolist()
            for (seq, _), token in zip(firsts, ids):
                self.scheduler.start(seq)
                self._emit(seq, token, Mode.EAGER, 1, None, None)
        return bool(firsts)

    def run_until_done(self, max_steps: int = 1_000_000) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        for _ in range(max_steps):
            if not self.has_work():
                break
            out.extend(self.step())
        out.extend(self._pending)
        self._pending = []
        return out

    # ---- internals ----
    def _prefill_groups(
        self, groups: list[list[Sequence]]
    ) -> Iterator[tuple[list[Sequence], torch.Tensor | None]]:
        """Each group with the last logits [V] of its prompt (a tensor of its own), prefilled into
        group[0]'s slot (None when that failed: the group is finished with the error). One pass
        over all the prompts where `_prefill_together` can, else one prefill per group."""
        for group in [g for g in groups if g[0].cached_tokens]:
            yield group, self._prefill_after(group)
        groups = [g for g in groups if not g[0].cached_tokens]
        together = self._prefill_together([g[0] for g in groups]) if len(groups) > 1 else None
        if together is not None:
            yield from zip(groups, together)
            return
        for group in groups:
            yield group, self._prefill(group)

    def _prefill(self, group: list[Sequence]) -> torch.Tensor | None:
        """Prefill group[0]'s prompt into its slot; returns the last logits [V]."""
        lead = group[0]
        ids = torch.tensor(lead.prompt_ids, dtype=torch.int64, device=self.device)
        try:
            return self.modes.prefill_logits(self.mode, ids, lead.slot, _only_argmax(group))
        except torch.OutOfMemoryError:
            return self._fail_group(group, "out of memory during prefill")

    def _fail_group(self, group: list[Sequence], message: str) -> None:
        """Every request of `group` (one whose prefill failed; or all, after a failed step) ends
        with `message` (one line)."""
        for seq in group:
            self._pending.append(EngineError(message, seq.request_id))
            self._finish(seq, "error")

    @property
    def reuses_prefixes(self) -> bool:
        """A prompt that starts with what a free slot still holds is prefilled from there
        (engine.prefix_reuse): on CPU unless FGCHAT_PREFIX_REUSE=0, on CUDA where =1. Work that
        writes slots outside a request's own rows (captures while idle, self-checks, the start-up
        check, a rebuild) forgets every history first."""
        reuse = self.tuning.prefix_reuse
        return reuse is True or (reuse is None and self.device.type == "cpu")

    def _choose_slot(self, seq: Sequence, free: list[int]) -> int:
        """The free slot for `seq` (SlotHistory.choose) and how many rows of its prompt are
        there before the prefill (seq.cached_tokens: kept in place, or copied from a donor slot
        whose history stays); the chosen slot's history ends here."""
        slot, seq.cached_tokens, donor = self.history.choose(seq.prompt_ids, free,
                                                             self._suffix_prefill_pays(len(seq.prompt_ids)))
        if donor is not None:
            self.cache.copy_prefix(donor, [slot], seq.cached_tokens)
        self.history.forget(slot)
        return slot

    def _suffix_prefill_pays(self, prompt_len: int) -> bool:
        """A prefill after cached rows runs eagerly; where a prefill graph would run the whole
        prompt (full mode), the graph is the faster one (the eager fused path launches ~10 kernels
        a layer from the host), so there the prompt is prefilled afresh."""
        graphs = self.modes.prefill_graphs
        return not (self.mode == Mode.FULL and graphs is not None and graphs.covers(prompt_len))

    def _prefill_after(self, group: list[Sequence]) -> torch.Tensor | None:
        """Prefill group[0]'s prompt from position seq.cached_tokens (the rows before it are in
        its slot); returns the last logits [V]."""
        from fgchat.engine.model.prefill import prefill_after

        lead = group[0]
        m = lead.cached_tokens
        ids = torch.tensor(lead.prompt_ids[m:], dtype=torch.int64, device=self.device)
        try:
            return prefill_after(self.decoder, ids, m, lead.slot, self.cache.k, self.cache.v, _only_argmax(group))
        except (RuntimeError, MemoryError) as exc:
            return self._fail_group(group, f"prefill failed: {one_line(exc)}")

    def _prefill_together(self, seqs: list[Sequence]) -> list[torch.Tensor] | None:
        """Several prompts in one pass, their last logits [V] each: stacked rows make larger
        matrix products (CPU, unfused: 8 x 64 tokens of SmolLM2 in 0.69 s instead of 1.04 s).
        None when it cannot run (no memory for the stacked rows): the caller then prefills one
        by one."""
        from fgchat.engine.model import prefill as pf

        run = pf.prefill_many_fused if self.decoder.fused else pf.prefill_many
        prompts = [(torch.tensor(s.prompt_ids, dtype=torch.int64, device=self.device), s.slot) for s in seqs]
        try:
            batch = self.modes.prefill_many_logits(self.mode, prompts)
            if batch is not None:
                return batch
            return run(self.decoder, prompts, self.cache.k, self.cache.v)
        except (RuntimeError, MemoryError):  # e.g. no memory for the stacked rows: one by one
            return None

    def _first_tokens(self, pairs: list[tuple[Sequence, torch.Tensor]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Each request's first token [1] from its prompt's last logits [V], in order. Requests
        without penalties are picked together, one pick over their stacked logits, as a decode
        step picks its lanes; a penalized one has its logits penalized first."""
        plain = [i for i, (seq, _) in enumerate(pairs) if not seq.params.penalized]
        toks: dict[int, torch.Tensor] = {}
        if plain:
            picked = self._pick(torch.stack([pairs[i][1] for i in plain]), [pairs[i][0] for i in plain])
            toks = {i: picked[j:j + 1] for j, i in enumerate(plain)}
        return [(seq, toks[i] if i in toks else self._first_token_penalized(seq, logits))
                for i, (seq, logits) in enumerate(pairs)]

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """First tokens [n] of `seqs` from their prompts' last logits [n, V]: all greedy, the
        chunked argmax (not torch.argmax's single block); else the sampler with each row's
        parameters at the position after its prompt."""
        ps = [s.params for s in seqs]
        if all(p.temperature <= 0 for p in ps):
            return sampling.greedy(logits)
        dev = self.device
        return sampling.sample(
            logits.float(), torch.tensor([p.temperature for p in ps], device=dev),
            torch.tensor([p.top_p for p in ps], device=dev), torch.tensor([p.top_k for p in ps], device=dev),
            torch.tensor([p.seed for p in ps], device=dev),
            torch.tensor([len(s.prompt_ids) for s in seqs], device=dev),
            filtered=any(sampling.needs_filter(p.top_p, p.top_k, self.cfg.vocab_size) for p in ps),
        )

    def _first_token_penalized(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """A penalized request's first token [1]: its prompt's ids counted from here (output ids
        as they are sampled), its last logits [V] penalized, then picked."""
        from fgchat.engine.kernels import penalties

        p = seq.params
        dev = self.device
        prog = self.program
        slot = torch.tensor([seq.slot], device=dev)
        penalties.reset_slot(prog.counts, prog.prompt_mask, seq.slot, seq.prompt_ids)
        logits = logits.float().clone()[None]
        penalties.apply_penalties(logits, prog.counts, prog.prompt_mask, slot,
                                  torch.tensor([p.repetition_penalty], device=dev),
                                  torch.tensor([p.presence_penalty], device=dev),
                                  torch.tensor([p.frequency_penalty], device=dev))
        tok = self._pick(logits, [seq])
        penalties.record_tokens(prog.counts, slot, tok)
        return tok

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
        mode = self.mode
        cuda = self.device.type == "cuda"
        events = None
        if cuda:
            self._flip ^= 1
            events = self._event_sets[self._flip]
            events[0].record()
        t0 = time.perf_counter()
        out, ran = self.modes.run(mode, b, variant)
        launch_ms = (time.perf_counter() - t0) * 1e3
        if ran != mode:  # capturing `mode` ran out of memory; ModeSet disabled it
            self.mode = ran
            self._pending.append(ModeChanged(ran, f"{mode} disabled: out of memory"))
            self._info_due = True
            mode = ran
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
        for seq, tok in zip(inf.seqs, tokens):
            if any(seq is r for r in running):  # finished or cancelled lanes drop their token
                self._emit(seq, tok, inf.mode, b, gpu_ms, inf.graph, inf.launch_ms)

    def _drain(self) -> None:
        inf, self._inflight = self._inflight, None
        if inf is not None:
            self._collect(inf)

    def _emit(
        self, seq: Sequence, token: int, mode: Mode, b: int, gpu_ms: float | None, graph: str | None,
        launch_ms: float | None = None,
    ) -> None:
        now = _now()
        first = not seq.output_ids
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
                graph=graph, launch_ms=launch_ms,
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
                )
            )
        )
