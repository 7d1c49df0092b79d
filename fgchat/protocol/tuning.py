"""The engine's switches: the choices a user or a benchmark really makes between kernel paths,
read from the environment in one place. Each picks between implementations of the same step; the
defaults measured fastest on the H200 (docs/notes/decode-step.md, "Switches"). Everything else the
notes measured is a constant beside the code it steers. No torch import: the UI process builds an
EngineConfig (which holds a Tuning) without loading torch.

| variable | default | what it chooses |
|---|---|---|
| FGCHAT_FUSED=0 | on | plain torch ops instead of the fused Triton kernels (CUDA) |
| FGCHAT_RESIDUAL_FP32=0 | on | fused path: residual stream in the model's dtype, as transformers keeps it |
| FGCHAT_PIPELINE=0 | on | read step n's tokens before launching step n+1 (CUDA) |
| FGCHAT_GEMV=0 | on | cuBLAS for every projection instead of our skinny kernel where it wins |
| FGCHAT_PROJ_CONFIGS=spec | "" | tiles per projection role, e.g. "gate_up=64,128,4,4;qkv=32,256,4,4,1" |
| FGCHAT_TMA=1 | off | Hopper bulk copies (TMA) for the o projection's and 8B gate/up's weight tiles (sm_90+) |
| FGCHAT_PIECEWISE_O=1 | off | the o projection launched with the attention (piecewise: outside its graphs) |
| FGCHAT_PROJ_PRELOAD=1 | 2 | weight tiles our qkv, o and down projections load before their PDL wait |
| FGCHAT_PDL=0 | on | no programmatic dependent launch between the step's Triton kernels |
| FGCHAT_L2_PREFETCH_MB=n | 16 | full graphs: weights prefetched into L2 beside attention (0: none) |
| FGCHAT_PIECEWISE_PREFETCH=0/1 | where layers fit | piecewise graphs: the same L2 prefetch, forked at each layer's norm and joined before its attention |
| FGCHAT_L2_PREFETCH_LEAD=0/1 | batch 4+, o fits | full graphs: a gate/up too large for that budget gets its leading K tiles prefetched |
| FGCHAT_PREFILL_GRAPHS=0 | on | full mode prefills eagerly instead of replaying prefill graphs |
| FGCHAT_EAGER_LAUNCH_LIST=0 | on | eager runs every step through the Python stages, not a recorded launch list |
| FGCHAT_BATCHED_PREFILL=0 | on | CUDA: distinct prompts admitted together are prefilled one by one, not in one pass |
| FGCHAT_HEAD_SAMPLE=0 | on | sampled steps pick in separate kernels after the LM head, not in its epilogue |
| FGCHAT_HEAD_PICK=0/1 | on (CUDA: one row, heads of 128 MB and up) | greedy picks from a low-precision copy of the LM head (CPU bf16, CUDA int8), candidates rescored exactly |
| FGCHAT_CPU_PACKED=0 | on | CPU: projections through F.linear instead of oneDNN's packed weights |
| FGCHAT_CPU_MALLOC=0 | on | CPU: glibc's default malloc thresholds (freed blocks of 1-32 MB go back to the OS) |
| FGCHAT_CPU_ATTN_HALF=0/1 | timed at start | CPU: decode attention of a bf16/fp16 cache in float32 copies (0) or in its own dtype (1) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fgchat.protocol.errors import FgchatError

PROJ_ROLES = ("qkv", "o", "gate_up", "down", "head")


_ON = frozenset({"1", "on", "yes", "true"})
_OFF = frozenset({"0", "off", "no", "false"})


def _flag(name: str, default: bool) -> bool:
    """An on/off switch; anything but 1/0, on/off, yes/no, true/false is a user error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in _ON:
        return True
    if raw.lower() in _OFF:
        return False
    raise FgchatError(f"{name} must be 1 or 0 (on or off), got {raw!r}")


def _tristate(name: str, default: bool | None) -> bool | None:
    """A flag whose default depends on the device (None), unless the environment sets it."""
    raw = os.environ.get(name, "").strip()
    return _flag(name, False) if raw else default


def _int(name: str, default: int) -> int:
    """A count >= 0; anything else is a user error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise FgchatError(f"{name} must be a whole number >= 0, got {raw!r}")
    return value


def _preload_tiles(default: int) -> int:
    """FGCHAT_PROJ_PRELOAD: 1 or 2 weight tiles before the PDL wait; anything else is a user error."""
    value = _int("FGCHAT_PROJ_PRELOAD", default)
    if value not in (1, 2):
        raise FgchatError(f"FGCHAT_PROJ_PRELOAD must be 1 or 2 (weight tiles before the wait), got {value}")
    return value


@dataclass(frozen=True)
class Tuning:
    fused: bool = True  # Triton kernels where CUDA + Triton exist
    # bf16 rounds a massive activation channel (~2.5e4) by up to 64 per add (real-weights notes)
    residual_fp32: bool = True
    # launch step n+1 (inputs fed on the device) before reading step n; None: on with CUDA
    pipeline: bool | None = None
    gemv: bool = True
    proj_configs: str = ""
    # the o projection's short split slices and an 8B-sized gate/up load weights by TMA where the
    # GPU has it (kernels.tma); off until measured in the whole step (notes V61)
    tma: bool = False
    # the o projection launched with the attention call, so piecewise runs it outside its graphs
    # right behind the attention (its PDL overlap kept; the boundary moves to o -> add+norm); off
    # until measured on the GPU (notes V65)
    piecewise_o: bool = False
    # weight tiles our qkv, o and down projections load before their PDL wait (1 or 2; 2: a slice
    # of two tiles, 1B's o on the wide-K tile, reads all its weights during attention; H200, 1B
    # full: 0.865 -> 0.855 ms at batch 1, notes V91)
    proj_preload: int = 2
    pdl: bool = True
    l2_prefetch_mb: int = 16
    # a gate/up that does not fit the L2 budget whole gets its leading K tiles prefetched (every
    # program reads them first; engine.model.fused_step.LEAD_BUDGET_MB). None: in graphs of
    # LEAD_MIN_ROWS rows and more, after an o that fits the budget whole (H100, 1B: batch 8 -21
    # us, batch 1 +33 us; 8B, whose o does not fit: batch 8 +116 us; notes V94)
    l2_prefetch_lead: bool | None = None
    # piecewise graphs fork the L2 prefetch at each layer's first stage, joined before the piece
    # ends at its attention call (full graphs fork it beside attention). None: where every layer's
    # plan holds its o, gate/up and down whole (latency-bound layers; H100, SmolLM2 piecewise
    # 0.737 -> 0.690 ms at batch 1), not where it holds o alone beside a qkv that streams from HBM
    # (1B: 1.126 -> 1.166; notes V95)
    piecewise_prefetch: bool | None = None
    prefill_graphs: bool = True
    eager_launch_list: bool = True
    batched_prefill: bool = True
    # prompts admitted together as one padded batch (model.prefill.batch_bucket), a CUDA graph per
    # shape in full mode (notes: decode-step.md, V33); fused decoders only
    prefill_batch_route: bool = True
    # while idle, decode graphs are captured again after a prefill graph was captured behind them
    # (the batch route's on first use; the engine process's deferred prefill captures): a later
    # capture slowed their replays by ~30 us a step, and captured again they were back to within
    # ~4 us (H100, notes V85)
    recapture_decode: bool = True
    # capture only the first mode's batch-1 graph before the engine is ready, the rest while idle
    # (start-up; notes: startup.md). Off for an Engine used directly (bench, generate, tests: every
    # graph captured at start); the engine process turns it on (process.engine_process_config),
    # its serve loop being what runs the deferred captures
    idle_capture: bool = False
    # the unfiltered, unpenalized sampled pick in the LM head kernel's epilogue (notes V37)
    head_sample: bool = True
    # greedy picks (CUDA: also unfiltered sampled ones) read a low-precision copy of the LM head
    # and recompute only the candidates exactly: CPU a packed bf16 copy (model.cpu_head_pick), CUDA
    # an int8 copy of a half-precision head (kernels.head_pick). None: on, on CUDA only where it
    # paid (one row, heads of head_pick.PAYS_BYTES; notes V63); True: every batch and head
    head_pick: bool | None = None
    # CPU: the plain path's projections through oneDNN's packed weights (model.cpu_linear)
    cpu_packed: bool = True
    # CPU: freed blocks of up to 32 MB kept by glibc's malloc for reuse (engine.cpu_malloc)
    cpu_malloc: bool = True
    # CPU: decode steps through one compiled function (engine.cpu_compiled; batch 1's package, and
    # the batch package once a batch ran), built once per weights in a child process while the
    # engine serves eagerly. Off for an Engine used directly (tests, generate); the engine process
    # (process.engine_process_config) and the bench (bench.runner) turn it on
    cpu_compile: bool = False
    # CPU: the compiled step's products from inductor's C++ GEMM templates, each picked against
    # oneDNN's packed product by timing both while the package is built (engine.cpu_compiled)
    cpu_gemm_templates: bool = True
    # CPU decode attention of a half-precision cache in its own dtype (True) or through float32
    # copies (False); None: whichever is faster on this machine (attention.cpu_sdpa.half_kernel_pays)
    cpu_attn_half: bool | None = None
    # a prompt that starts with the tokens a free cache slot still holds (the previous turn of a
    # chat) is prefilled from there (engine.prefix_reuse). None: on CPU only (on CUDA the eager
    # suffix prefill measured slower than a fresh prefill at chat lengths; notes V71); True: on
    # CUDA too, where the whole prompt would run eagerly as well
    prefix_reuse: bool | None = None

    @classmethod
    def from_env(cls, defaults: Tuning | None = None) -> Tuning:
        """The switches the environment sets; the rest from `defaults` (the class defaults)."""
        d = defaults if defaults is not None else cls()
        return cls(
            fused=_flag("FGCHAT_FUSED", d.fused),
            residual_fp32=_flag("FGCHAT_RESIDUAL_FP32", d.residual_fp32),
            pipeline=None if _flag("FGCHAT_PIPELINE", True) else False,
            gemv=_flag("FGCHAT_GEMV", d.gemv),
            proj_configs=os.environ.get("FGCHAT_PROJ_CONFIGS", d.proj_configs).strip(),
            tma=_flag("FGCHAT_TMA", d.tma),
            piecewise_o=_flag("FGCHAT_PIECEWISE_O", d.piecewise_o),
            pdl=_flag("FGCHAT_PDL", d.pdl),
            l2_prefetch_mb=_int("FGCHAT_L2_PREFETCH_MB", d.l2_prefetch_mb),
            l2_prefetch_lead=_tristate("FGCHAT_L2_PREFETCH_LEAD", d.l2_prefetch_lead),
            piecewise_prefetch=_tristate("FGCHAT_PIECEWISE_PREFETCH", d.piecewise_prefetch),
            proj_preload=_preload_tiles(d.proj_preload),
            prefill_graphs=_flag("FGCHAT_PREFILL_GRAPHS", d.prefill_graphs),
            eager_launch_list=_flag("FGCHAT_EAGER_LAUNCH_LIST", d.eager_launch_list),
            batched_prefill=_flag("FGCHAT_BATCHED_PREFILL", d.batched_prefill),
            prefill_batch_route=_flag("FGCHAT_PREFILL_BATCH_ROUTE", d.prefill_batch_route),
            recapture_decode=_flag("FGCHAT_RECAPTURE_DECODE", d.recapture_decode),
            idle_capture=_flag("FGCHAT_IDLE_CAPTURE", d.idle_capture),
            head_sample=_flag("FGCHAT_HEAD_SAMPLE", d.head_sample),
            head_pick=_tristate("FGCHAT_HEAD_PICK", d.head_pick),
            cpu_packed=_flag("FGCHAT_CPU_PACKED", d.cpu_packed),
            cpu_malloc=_flag("FGCHAT_CPU_MALLOC", d.cpu_malloc),
            cpu_compile=_flag("FGCHAT_CPU_COMPILE", d.cpu_compile),
            cpu_gemm_templates=_flag("FGCHAT_CPU_GEMM_TEMPLATES", d.cpu_gemm_templates),
            cpu_attn_half=_tristate("FGCHAT_CPU_ATTN_HALF", d.cpu_attn_half),
            prefix_reuse=_tristate("FGCHAT_PREFIX_REUSE", d.prefix_reuse),
        )

    def proj_config_texts(self) -> dict[str, str]:
        """FGCHAT_PROJ_CONFIGS as {role: "bn,bk,warps,stages[,swap]"}; raises ValueError if malformed."""
        out: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in self.proj_configs.split(";"))):
            role, sep, cfg = item.partition("=")
            if not sep or role.strip() not in PROJ_ROLES:
                raise ValueError(f"FGCHAT_PROJ_CONFIGS item {item!r}: expected ROLE=bn,bk,warps,stages "
                                 f"with ROLE one of {', '.join(PROJ_ROLES)}")
            out[role.strip()] = cfg.strip()
        return out

    def changed(self) -> dict[str, object]:
        """The switches that differ from the defaults (recorded with benchmark results)."""
        d = Tuning()
        return {k: v for k, v in self.__dict__.items() if getattr(d, k) != v}
