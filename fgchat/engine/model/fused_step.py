"""The fused decode stages (CUDA + Triton): which kernel runs each part of a layer, and how the
launches chain.

Routing is decided once, from weight shapes that every layer shares, so eager steps and captured
graphs launch identical kernels (modes stay bit-identical):
- a projection runs on our skinny kernel (engine.gemv) where that beat cuBLAS, else on cuBLAS;
- the o and down projections feed the next add+RMSNorm; when their output is narrow they run on
  our kernel split along K into float32 partial sums that the norm adds in a fixed order (more
  programs in flight, and no reduce launch);
- the gate/up projection carries SiLU-and-multiply in its epilogue (one launch, Tuning.glu);
- programmatic dependent launch (engine.pdl) is used for every Triton launch of the step, or,
  with Tuning.pdl_after_library off, only where the predecessor in the stream is one of our
  Triton kernels (a library kernel that lets dependents launch early would then share its SMs
  with our waiting programs).
  Either way each kernel waits for its predecessor before touching its data, so PDL never
  changes results; it only lets a kernel start (and load weights) while the previous drains.
- whole-step graphs may run `beside_attention(i)` on a side branch: an L2 prefetch of the weights
  that follow attention (engine.l2_prefetch); it reads nothing a kernel writes and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fgchat.engine.kernels import fused as fk
from fgchat.engine.kernels import gemv
from fgchat.engine.kernels import l2_prefetch
from fgchat.protocol.errors import FgchatError
from fgchat.engine.model.decoder import head_logits
from fgchat.protocol.tuning import Tuning

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder, StepState


@dataclass(frozen=True)
class Route:
    """How one projection runs: on our kernel (split > 1: partial sums; glu: gate/up with the
    activation in its epilogue; config None: gemv.pick_config's) or on cuBLAS."""

    ours: bool
    split: int = 1
    glu: bool = False
    config: gemv.ProjConfig | None = None

    def serves(self, rows: int) -> bool:
        """Our kernel runs this projection for `rows` activation rows (else cuBLAS does)."""
        return self.ours and rows <= gemv.MAX_ROWS


class FusedStages:
    def __init__(self, dec: Decoder, tuning: Tuning, sm_count: int, pdl: bool) -> None:
        self.dec = dec
        self.t = tuning
        self.pdl = pdl
        self.configs = _configs(tuning)
        lw = dec.w.layers[0]
        self.qkv = self._route("qkv", lw.wqkv, lw.bqkv is None, feeds_norm=False, sm_count=sm_count)
        self.o = self._route("o", lw.wo, True, feeds_norm=True, sm_count=sm_count)
        self.gate_up = self._route("gate_up", lw.w_gate_up, True, feeds_norm=False, sm_count=sm_count)
        self.down = self._route("down", lw.w_down, True, feeds_norm=True, sm_count=sm_count)
        self.head_ours = tuning.lm_head_gemv
        self.head_config = self.configs.get("head")
        self.attention_ours = False
        self.rope_in_attention = False
        budget = tuning.l2_prefetch_mb * 2**20
        dev = lw.wo.device
        self.prefetch: list[list[l2_prefetch.Range]] | None = None
        if budget > 0 and l2_prefetch.supported(dev):
            plans = [l2_prefetch.plan([w.wo, w.w_gate_up, w.w_down], budget) for w in dec.w.layers]
            self.prefetch = plans if any(plans) else None

    def _route(self, role: str, w: torch.Tensor, bias_free: bool, feeds_norm: bool, sm_count: int) -> Route:
        t, cfg = self.t, self.configs.get(role)
        if not (t.gemv and bias_free):
            return Route(False)
        if role == "gate_up" and t.glu:
            return Route(True, glu=True, config=cfg)
        # qkv on our kernel at every size where PDL chains the step: its programs let the attention
        # kernel launch early and load its K/V meanwhile, which a library kernel does not
        if role == "qkv" and t.qkv_gemv and self.pdl:
            return Route(True, config=cfg)
        # a role given a tile (FGCHAT_PROJ_CONFIGS) runs on our kernel whatever its size
        mine = cfg is not None
        # Narrow norm-fed outputs: more programs in flight, partial sums left to the norm (H200:
        # 1B o 5.0 -> 4.1 us); larger ones (1B down) stay on cuBLAS by gemv_max_split.
        if feeds_norm and t.split_k and w.shape[0] <= t.split_max_n and (
                mine or gemv.wins_over_cublas(w, t.gemv_max_split, t.gemv_big)):
            return Route(True, gemv.pick_split(w.shape[0], w.shape[1], sm_count, cfg), config=cfg)
        return Route(mine or gemv.wins_over_cublas(w, t.gemv_max_elements, t.gemv_big), config=cfg)

    def after(self, predecessor_ours: bool) -> bool:
        """PDL for a launch following a kernel that is ours (True) or a library kernel."""
        return self.pdl and (predecessor_ours or self.t.pdl_after_library)

    def bind_attention(self, rope_in_attention: bool, attention_ours: bool) -> bool:
        """Record how attention runs; returns PDL for the attention's first kernel."""
        self.rope_in_attention = rope_in_attention
        self.attention_ours = attention_ours
        return self.after(self.qkv.ours or not rope_in_attention)

    def _project(self, x: torch.Tensor, w: torch.Tensor, route: Route, predecessor_ours: bool,
                 pdl_allowed: bool = True) -> torch.Tensor:
        if not route.serves(x.shape[0]):
            return F.linear(x, w)
        pdl = pdl_allowed and self.after(predecessor_ours)
        if route.split > 1:
            return gemv.project_partials(x, w, route.split, route.config, pdl=pdl)
        return gemv.project(x, w, route.config, pdl=pdl)

    def beside_attention(self, i: int) -> None:
        """Request layer i's o (then gate/up, down) weights into L2; see Decoder.side_work."""
        if self.prefetch is not None:
            l2_prefetch.issue(self.prefetch[i])

    # ---- stages (see Decoder for their contracts) ----
    def before_attention(self, i: int, st: StepState, positions: torch.Tensor, slot_ids: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        c, lw = self.dec.cfg, self.dec.w.layers[i]
        # layer 0 follows the embedding (a torch kernel); later layers the previous down projection
        st.h, x = fk.add_rms_norm(st.h, st.delta, lw.attn_norm, c.rms_eps, self.after(i > 0 and self.down.ours),
                                  self.dec.residual_dtype)
        st.delta = None
        if lw.bqkv is not None:
            qkv = F.linear(x, lw.wqkv, lw.bqkv)
        else:
            qkv = self._project(x, lw.wqkv, self.qkv, True)
        if self.rope_in_attention:  # the attention call applies RoPE and writes K/V
            st.qkv = qkv
            return
        st.q = fk.rope_kv_write(qkv, self.dec.cos, self.dec.sin, positions, slot_ids, k_cache, v_cache,
                                c.num_heads, c.num_kv_heads, c.head_dim, self.after(self.qkv.ours))

    def after_attention(self, i: int, st: StepState, attn_out: torch.Tensor) -> None:
        c, lw = self.dec.cfg, self.dec.w.layers[i]
        o = self._project(attn_out.view(attn_out.shape[0], -1), lw.wo, self.o, self.attention_ours,
                          self.t.pdl_after_attention)
        st.h, x = fk.add_rms_norm(st.h, o, lw.mlp_norm, c.rms_eps, self.after(self.o.ours), self.dec.residual_dtype)
        if self.gate_up.glu and self.gate_up.serves(x.shape[0]):
            act = gemv.project_glu(x, lw.w_gate_up, self.gate_up.config, pdl=self.after(True))
        else:
            gu = self._project(x, lw.w_gate_up, self.gate_up, True)
            act = fk.silu_mul(gu, self.after(self.gate_up.serves(x.shape[0])))
        st.delta = self._project(act, lw.w_down, self.down, True)

    def head(self, st: StepState, greedy: bool) -> None:
        dec = self.dec
        st.h, x = fk.add_rms_norm(st.h, st.delta, dec.w.final_norm, dec.cfg.rms_eps, self.after(self.down.ours),
                                  dec.residual_dtype)
        st.delta = None
        if self.head_ours and x.shape[0] <= gemv.MAX_ROWS:
            if greedy:
                st.logits, st.tokens = gemv.project_argmax(x, dec.w.lm_head, self.head_config,
                                                           pdl=self.after(True))
            else:
                st.logits = gemv.project_logits(x, dec.w.lm_head, self.head_config, pdl=self.after(True))
        else:
            st.logits = head_logits(x, dec.w.lm_head)


def _configs(tuning: Tuning) -> dict[str, gemv.ProjConfig]:
    """Tile overrides per projection role (FGCHAT_PROJ_CONFIGS); a malformed one is a user error."""
    try:
        return {role: gemv.ProjConfig.parse(text) for role, text in tuning.proj_config_texts().items()}
    except ValueError as exc:
        raise FgchatError(str(exc)) from None
