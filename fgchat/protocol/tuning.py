"""The engine's switches: the choices a user really makes between kernel paths, read from the
environment in one place. No torch import: the UI process builds an EngineConfig (which holds a
Tuning) without loading torch.

| variable | default | what it chooses |
|---|---|---|
| FGCHAT_FUSED=0 | on | plain torch ops instead of the fused Triton kernels (CUDA) |
| FGCHAT_PROJ_CONFIGS=spec | "" | tiles per projection role (tuning a new GPU), e.g. "o=32,256,4,3,1,4" |

The other fields are set by code, never by the environment: tests force one side of a rule the
engine otherwise decides by itself, and the engine process and the bench pick their own start-up.
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class Tuning:
    # FGCHAT_FUSED: Triton kernels where CUDA + Triton exist (off: plain torch ops)
    fused: bool = True
    # FGCHAT_PROJ_CONFIGS: tile overrides per projection role (proj_config_texts)
    proj_configs: str = ""
    # greedy picks from a low-precision copy of the LM head, candidates rescored exactly (CPU: a
    # packed bf16 copy; CUDA: int8, kernels.head_pick). None: on CPU, on CUDA where it pays
    # (head_pick.pays); True: every head and batch; False: the exact head (tests)
    head_pick: bool | None = None
    # full graphs: a gate/up too large for the L2 budget gets its leading K tiles prefetched.
    # None: in graphs of fused_step.LEAD_MIN_ROWS rows and more (tests force either side)
    l2_prefetch_lead: bool | None = None
    # piecewise graphs fork the L2 prefetch at each layer's first stage. None: where every layer's
    # o, gate/up and down fit the budget whole (FusedStages.layers_fit; tests force either side)
    piecewise_prefetch: bool | None = None
    # CPU decode attention of a half-precision cache in its own dtype (True) or through float32
    # copies (False). None: whichever is faster on this machine (cpu_sdpa.half_kernel_pays)
    cpu_attn_half: bool | None = None
    # capture only the first mode's batch-1 graph before the engine is ready, the rest while idle;
    # the engine process turns it on (process.engine_process_config)
    idle_capture: bool = False
    # a prompt that starts with the tokens a free cache slot still holds is prefilled from there
    # (engine.prefix_reuse). None: on CPU only; True: on CUDA too
    prefix_reuse: bool | None = None

    @classmethod
    def from_env(cls, defaults: Tuning | None = None) -> Tuning:
        """`defaults` (the class defaults) with the switches the environment sets."""
        d = defaults if defaults is not None else cls()
        return dataclasses.replace(
            d,
            fused=_flag("FGCHAT_FUSED", d.fused),
            proj_configs=os.environ.get("FGCHAT_PROJ_CONFIGS", d.proj_configs).strip(),
        )

    def proj_config_texts(self) -> dict[str, str]:
        """FGCHAT_PROJ_CONFIGS as {role: "bn,bk,warps,stages[,swap[,split]]"}; raises ValueError if malformed."""
        out: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in self.proj_configs.split(";"))):
            role, sep, cfg = item.partition("=")
            if not sep or role.strip() not in PROJ_ROLES:
                raise ValueError(f"FGCHAT_PROJ_CONFIGS item {item!r}: expected ROLE=bn,bk,warps,stages "
                                 f"with ROLE one of {', '.join(PROJ_ROLES)}")
            out[role.strip()] = cfg.strip()
        return out

    def changed(self) -> dict[str, object]:
        """The fields that differ from the defaults (recorded with benchmark results)."""
        d = Tuning()
        return {k: v for k, v in self.__dict__.items() if getattr(d, k) != v}
