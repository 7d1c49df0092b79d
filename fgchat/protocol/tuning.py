"""Switches of the decode step's kernel paths, read from the environment in one place.

Every switch only picks between implementations that compute the same step; the defaults are the
variants that measured fastest on the H200 (docs/notes/decode-step.md). No torch import: the UI
process builds an EngineConfig (which holds a Tuning) without loading torch.

Environment (read by `Tuning.from_env`, once per engine):
  FGCHAT_FUSED=0              torch ops instead of the fused Triton kernels
  FGCHAT_RESIDUAL_FP32=0      fused path: the residual stream in the model's dtype (as transformers
                              keeps it), not float32
  FGCHAT_PIPELINE=0           read step n's tokens before launching step n+1
  FGCHAT_DEVICE_ADVANCE=0     step n+1's inputs and the host's copy of step n's tokens by torch copies
  FGCHAT_GEMV=0               cuBLAS for every projection
  FGCHAT_GEMV_MAX=<elements>  largest weight our projection kernel serves (default 2048*2048)
  FGCHAT_SPLIT_K=0            o and down never split K
  FGCHAT_SPLIT_MAX_N=<n>      o / down with at most n outputs run split-K on our kernel (4096)
  FGCHAT_GEMV_MAX_SPLIT=<n>   ... and at most n weight elements (default 2048*2048: 1B o, not down)
  FGCHAT_GEMV_BIG=0           cuBLAS for projections with both sides >= 4096 (8B qkv, o, down)
  FGCHAT_LM_HEAD_GEMV=0       cuBLAS for the LM head
  FGCHAT_GLU=0                gate/up on its own, then SiLU-and-multiply as a second kernel
  FGCHAT_PROJ_CONFIGS=<spec>  our projection kernel's tiles per role instead of the shape rule,
                              e.g. "gate_up=64,128,4,4;qkv=32,256,4,4,1" (gemv.ProjConfig.parse);
                              roles qkv, o, gate_up, down, head; a role listed runs on our kernel
                              whatever its size (o / down split K as without the override)
  FGCHAT_ROPE_IN_ATTENTION=0  RoPE + K/V write as its own kernel
  FGCHAT_FUSED_COMBINE=1      the last attention split merges the others
  FGCHAT_ATTN_PRELOAD=0       each attention split loads its first K/V tile after its PDL wait
  FGCHAT_ATTN_CUR_FROM_CACHE=1  with the preload, re-read the current K/V row from the cache (bit-identical
                              to FGCHAT_ROPE_IN_ATTENTION=0; not from registers)
  FGCHAT_QKV_GEMV=0           the qkv projection on our kernel only where it is small or big (else cuBLAS)
  FGCHAT_PDL=0                no programmatic dependent launch between the Triton kernels
  FGCHAT_PDL_AFTER_LIBRARY=0  PDL only for a Triton kernel that follows one of our kernels
  FGCHAT_PDL_AFTER_ATTENTION=0  the o projection waits for attention to end before it launches
  FGCHAT_PREFILL_GRAPHS=0     full mode prefills eagerly instead of replaying a prefill graph
  FGCHAT_PREFILL_OWN_POOL=1   prefill graphs get their own memory pool (not the decode graphs')
  FGCHAT_PREFILL_FIRST=0      prefill graphs are captured after the decode graphs (3% slower decode)
  FGCHAT_PREFILL_REPLAY=0     prefill graphs are captured but prefill runs eagerly (experiment)
  FGCHAT_EAGER_LAUNCH_LIST=0  eager runs every step through the stages (not a launch list recorded
                              from its first greedy step at each batch size; engine.launch_list)
  FGCHAT_BOUND_ATTENTION=0    piecewise replay launches each attention through its full Python path
                              (not a launch prepared once per batch size and layer)
  FGCHAT_L2_PREFETCH_MB=<mb>  full graphs: weights requested into L2 beside each attention call:
                              o, gate/up, down while each fits whole (engine.l2_prefetch); 0 = none
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_GEMV_MAX = 2048 * 2048
PROJ_ROLES = ("qkv", "o", "gate_up", "down", "head")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in {"0", "off", "no", "false"}


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(float(raw)) if raw else default
    except ValueError:
        return default


@dataclass(frozen=True)
class Tuning:
    fused: bool = True  # Triton kernels where CUDA + Triton exist
    # The fused path's residual stream in float32 (docs/notes/real-weights.md): bf16 rounds a
    # massive activation channel (~2.5e4) by up to 64 per add; CPU, SmolLM2-135M, 8 prompts x 4
    # paddings: logits' error vs float32 mean 0.018 -> 0.011, max 0.056 -> 0.032
    residual_fp32: bool = True
    pipeline: bool = True  # on CUDA only
    device_advance: bool = True  # fused.advance after each CUDA step
    gemv: bool = True
    gemv_max_elements: int = DEFAULT_GEMV_MAX
    split_k: bool = True
    split_max_n: int = 4096
    # H200, one run: Llama-3.1-8B 4.461 ms (cuBLAS) -> 4.239 with qkv, o, down on our kernel
    gemv_big: bool = True
    # H200, one run: 1B down on cuBLAS 1.009 / 1.090 ms vs split on ours 1.017 / 1.110 (b1 / b8)
    gemv_max_split: int = DEFAULT_GEMV_MAX
    lm_head_gemv: bool = True
    # gate/up projection with SiLU-and-multiply in its epilogue on our kernel: one launch
    glu: bool = True
    proj_configs: str = ""
    rope_in_attention: bool = True
    fused_combine: bool = False
    # H200, one call (be7ca3f, 1B full batch 1): 0.962 ms default, 0.957 qkv on our kernel, 0.960
    # preload after cuBLAS's qkv, 0.929 both; SmolLM2 (qkv already ours) 0.536 -> 0.509 with preload
    attention_preload: bool = True
    # The current K/V row from registers (False) skips a re-read of ~13 us per 1B step (H200,
    # 2836063 vs 28de800); re-reading it (True) makes RoPE-in-attention bit-identical to the
    # separate cache-write kernel at head dim 64. Every mode of one engine runs the same path.
    attention_cur_from_cache: bool = False
    qkv_gemv: bool = True
    # Programmatic dependent launch (sm_90+): each Triton kernel of the step may start (and load
    # weights) while the previous kernel drains; it waits for that kernel before reading its output.
    pdl: bool = True
    pdl_after_library: bool = True
    # H200, one call: 1B 0.9557 ms with the o projection launched after attention ends, 0.9575 with
    # PDL (no L2 prefetch); 0.9631 vs 0.9530 with the prefetch
    pdl_after_attention: bool = True
    prefill_graphs: bool = True
    prefill_own_pool: bool = False
    # H100, one run: 1B full decode 1.203 ms with prefill graphs captured after the decode graphs,
    # 1.170 captured before (1.172 without prefill graphs); the pool does not matter
    prefill_first: bool = True
    prefill_replay: bool = True
    # H200, one call (2bc054f): SmolLM2 0.570 -> 0.538 ms, 1B 0.966 -> 0.960 (batch 8: 1.027 ->
    # 1.033); 8B's 33.5 MB o weight does not fit, so it gets none
    l2_prefetch_mb: int = 16
    bound_attention: bool = True
    eager_launch_list: bool = True

    @classmethod
    def from_env(cls) -> Tuning:
        d = cls()
        return cls(
            fused=_flag("FGCHAT_FUSED", d.fused),
            residual_fp32=_flag("FGCHAT_RESIDUAL_FP32", d.residual_fp32),
            pipeline=_flag("FGCHAT_PIPELINE", d.pipeline),
            device_advance=_flag("FGCHAT_DEVICE_ADVANCE", d.device_advance),
            gemv=_flag("FGCHAT_GEMV", d.gemv),
            gemv_max_elements=_int("FGCHAT_GEMV_MAX", d.gemv_max_elements),
            split_k=_flag("FGCHAT_SPLIT_K", d.split_k),
            split_max_n=_int("FGCHAT_SPLIT_MAX_N", d.split_max_n),
            gemv_big=_flag("FGCHAT_GEMV_BIG", d.gemv_big),
            gemv_max_split=_int("FGCHAT_GEMV_MAX_SPLIT", d.gemv_max_split),
            lm_head_gemv=_flag("FGCHAT_LM_HEAD_GEMV", d.lm_head_gemv),
            glu=_flag("FGCHAT_GLU", d.glu),
            proj_configs=os.environ.get("FGCHAT_PROJ_CONFIGS", d.proj_configs).strip(),
            rope_in_attention=_flag("FGCHAT_ROPE_IN_ATTENTION", d.rope_in_attention),
            fused_combine=_flag("FGCHAT_FUSED_COMBINE", d.fused_combine),
            attention_preload=_flag("FGCHAT_ATTN_PRELOAD", d.attention_preload),
            attention_cur_from_cache=_flag("FGCHAT_ATTN_CUR_FROM_CACHE", d.attention_cur_from_cache),
            qkv_gemv=_flag("FGCHAT_QKV_GEMV", d.qkv_gemv),
            pdl=_flag("FGCHAT_PDL", d.pdl),
            pdl_after_library=_flag("FGCHAT_PDL_AFTER_LIBRARY", d.pdl_after_library),
            pdl_after_attention=_flag("FGCHAT_PDL_AFTER_ATTENTION", d.pdl_after_attention),
            prefill_graphs=_flag("FGCHAT_PREFILL_GRAPHS", d.prefill_graphs),
            prefill_own_pool=_flag("FGCHAT_PREFILL_OWN_POOL", d.prefill_own_pool),
            prefill_first=_flag("FGCHAT_PREFILL_FIRST", d.prefill_first),
            prefill_replay=_flag("FGCHAT_PREFILL_REPLAY", d.prefill_replay),
            l2_prefetch_mb=_int("FGCHAT_L2_PREFETCH_MB", d.l2_prefetch_mb),
            bound_attention=_flag("FGCHAT_BOUND_ATTENTION", d.bound_attention),
            eager_launch_list=_flag("FGCHAT_EAGER_LAUNCH_LIST", d.eager_launch_list),
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
