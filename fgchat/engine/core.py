"""The engine: admission + prefill, batched decode steps in the selected mode, token events.

`Engine` is the facade callers drive (submit, cancel, set_mode, step, info, ...); its parts live
in their own modules: construction of the decode path (engine.build), admission and prefill
routing (engine.prefill_route) and the decode loop (engine.decode_loop)."""

from __future__ import annotations

import os
import time

import torch

from fgchat.engine.build import EngineBuild, load_weights
from fgchat.engine.cpu_malloc import keep_freed_blocks, release_free_blocks
from fgchat.engine.decode_loop import DecodeLoop
from fgchat.engine.devices import pick_device, pick_dtype
from fgchat.engine.kv_cache import NUM_SLOTS, KVCache, choose_max_context
from fgchat.engine.loader import LoadedModel
from fgchat.engine.modes import GRAPH_MODES
from fgchat.engine.prefill_route import PrefillRoute
from fgchat.engine.prefix_reuse import SlotHistory
from fgchat.engine.requests import Sequence
from fgchat.engine.scheduler import Scheduler
from fgchat.engine.speculate.loop import SpecLoop
from fgchat.engine.startup_trace import startup_mark
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.errors import FgchatError, RequestError
from fgchat.protocol.events import EngineEvent, EngineInfo, Mode, ModeChanged, SamplingParams, StartupCheck
from fgchat.protocol.tuning import Tuning

STEP_GRAPHS_KEPT = 4096


class Engine(EngineBuild, PrefillRoute, DecodeLoop, SpecLoop):
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
            loaded = load_weights(config, self.device, self.dtype)
        self.model = loaded
        self.cfg = loaded.cfg
        self.tokenizer = loaded.tokenizer
        self.notes: list[str] = list(config.notes) + list(loaded.notes)
        self._describe_weights()
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
        self._init_decode_loop(STEP_GRAPHS_KEPT)
        self._init_speculation()
        self.mode = Mode.EAGER
        self._pending: list[EngineEvent] = []
        self._info_due = False  # a ModeChanged is pending: EngineInfo follows it from step()
        self._next_id = 1
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

    def _describe_weights(self) -> None:
        """The weights' format and bytes (EngineInfo) and the start-up note that names them."""
        from fgchat.engine.bandwidth import peak_bandwidth
        from fgchat.engine.quant.describe import step_read_bytes, weight_bytes, weight_format

        w = self.model.weights
        held, loaded = weight_format(w), self.model.weight_format
        # CPU: a quantized file or --quantize runs as dequantized copies ("Q4_1+Q8_0 as bf16")
        self.weights_format = f"{loaded} as {held}" if loaded and loaded != held else held
        self.weight_bytes = weight_bytes(w)
        self.step_bytes = step_read_bytes(w)
        self.peak_bandwidth = peak_bandwidth(self.device)
        where = self.device
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        self.notes.append(f"weights {self.weights_format}, {self.weight_bytes / 1e6:.1f} MB on {where}")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    # ---- public API ----
    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name=self.model.name,
            architecture=self.cfg.architecture,
            device=str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            dtype=self.dtype_name,
            max_context=self.max_context,
            num_layers=self.cfg.num_layers,
            attention_backend=self.attention_label,
            available_modes={str(m): why for m, why in self.modes.unavailable.items()},
            mode=self.mode,
            captures=self.modes.reports + self._spec_captures(),
            notes=list(self.notes),
            kernel_warmup_s=self.modes.kernel_warmup_s,
            startup_check=self.startup_check,
            startup_check_pending=self._check_pending,
            sampling_defaults=SamplingParams.from_generation_config(self.model.generation_config),
            sampling_source=self.model.sampling_source if self.model.generation_config else "",
            cpu_step="eager" if self.device.type == "cpu" else "",
            weights=self.weights_format,
            weight_bytes=self.weight_bytes,
            step_bytes=self.step_bytes,
            peak_bandwidth=self.peak_bandwidth,
            speculate=self.spec_method,
            draft_len=self.spec_draft_len if self.spec_method != "off" else 0,
            draft_model=self.spec_draft_name,
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
        """Capture `mode` at these batch sizes now (its verification steps too, with speculation
        on), with the start-up self-check, instead of on first use (a benchmark's timed rounds
        then hold no capture); a failure disables the mode as a first-use capture's would."""
        wanted = Mode(mode)
        if wanted in GRAPH_MODES and wanted in self.modes.modes and not self.modes.unavailable.get(wanted):
            self.modes.capture_sizes(wanted, sizes, self.config.self_check)
            self._spec_capture_sizes(wanted, sizes)  # the verification's, with speculation on
            self.history.clear()  # the self-check's steps write slots 0..b-1

    def capture_idle(self) -> bool:
        """While no request runs, one piece of work that start-up deferred (Tuning.idle_capture):
        the start-up check first, then one capture at a time (with speculation on, the
        verification's graphs after the decode ones); True when one ran. A mode whose
        capture or self-check failed is left for eager then (its ModeChanged comes out of the
        next step())."""
        if self.has_work():
            return False
        if self._trim_due:  # no event to report: the loop asks again, for the work below
            self._trim_due = False
            release_free_blocks()
        if self.run_startup_check():
            return True
        if not self.modes.capture_next() and not self._spec_capture_next():
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
        if params.oracle_tokens:  # the oracle's drafts for this prompt, given with the request
            self.spec_oracle.record(list(prompt_ids), list(params.oracle_tokens))
        seq = Sequence(rid, list(prompt_ids), params, stops, time.monotonic_ns())
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
        elif self.scheduler.running and self._spec_wanted(list(self.scheduler.running)) and self._spec_step():
            pass  # a speculative step ran (speculate.loop)
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

    def run_until_done(self, max_steps: int = 1_000_000) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        for _ in range(max_steps):
            if not self.has_work():
                break
            out.extend(self.step())
        out.extend(self._pending)
        self._pending = []
        return out
