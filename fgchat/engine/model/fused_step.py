"""The fused decode stages (CUDA + Triton): which kernel runs each part of a layer, and how the
launches chain.

Routing is decided once, from weight shapes that every layer shares, so eager steps and captured
graphs launch identical kernels (modes stay bit-identical):
- a projection runs on our skinny kernel (engine.gemv) where that beat cuBLAS, else on cuBLAS;
- the o and down projections feed the next add+RMSNorm; when their output is narrow they run on
  our kernel split along K into float32 partial sums that the norm adds in a fixed order (more
  programs in flight, and no reduce launch);
- the gate/up projection carries SiLU-and-multiply (Gemma: GELU(tanh)) in its epilogue (one launch);
- Qwen3's, Gemma 3's and Phi-3's extra ops ride on the same launches (families.fused_serves): the
  q/k norm and partial RoPE in rope_kv_write, Gemma's norms after attention and after the MLP in
  the add_rms_norm that adds their sublayer's output, its embedding scale in layer 0's; LongRoPE's
  per-position tables need nothing in decode, and a prefill past the original context reads the
  long rows (prefill_table_rows);
- a quantized weight (engine.quant: a QuantWeight, or a QuantStack of formats) runs on
  kernels.qgemv, which dequantizes its tiles in registers: always for up to MAX_TILED_ROWS rows (o
  and down split along K where that fills the SMs), through qgemv.linear's prefill path for more;
  its L2 prefetch takes the weight's planes, and a quantized gate/up adds no lead tiles;
- programmatic dependent launch (kernels.pdl) is used for every Triton launch of the step, the o
  projection's after attention included. Each kernel waits for its predecessor before touching
  its data, so PDL never changes results; it only lets a kernel start (and load weights) while
  the previous one drains.
- whole-step graphs may run `side_work(rows)(i)` on a side branch: an L2 prefetch of the weights
  that follow attention (engine.l2_prefetch); it reads nothing a kernel writes and writes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fgchat.engine.kernels import fused as fk
from fgchat.engine.kernels import gemv
from fgchat.engine.kernels import head_pick
from fgchat.engine.kernels import l2_prefetch
from fgchat.engine.kernels import qgemv
from fgchat.engine.kernels.qtiles import is_quantized
from fgchat.engine.model import families as fam
from fgchat.engine.model import quant_ops
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.tuning import Tuning

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder, StepState

# o / down outputs at most this wide run split-K on our kernel (partial sums the norm adds)
SPLIT_MAX_N = 4096
# shared memory a block may opt into on an H100 / H200 (227 KB): a CPU decoder's (tests) stand-in
H200_SMEM_PER_BLOCK = 227 * 1024
# the roles whose output feeds add+RMSNorm, which can add split-K partial sums
SPLIT_ROLES = ("o", "down")
# gate/up's leading K tiles join the L2 prefetch in graphs of at least LEAD_MIN_ROWS rows, within
# LEAD_BUDGET_MB with o before them (H100, 1B full: batch 4 1.131 -> 1.122 ms, batch 8 1.193 ->
# 1.172; batch 1 1.014 -> 1.047 and batch 2 1.082 -> 1.098, where the fills land on o; design.md V94)
LEAD_MIN_ROWS = 4
LEAD_BUDGET_MB = 32
# L2 prefetch budget beside attention (H100, 1B full batch 1: off 1.023, 16 MB 1.004, 32 MB 1.002 ms)
L2_PREFETCH_MB = 16
# weight tiles the qkv, o and down projections load before their PDL wait (H200, 1B full batch 1:
# 0.865 -> 0.855 ms with 2; design.md V91)
PROJ_PRELOAD = 2


@dataclass(frozen=True)
class Route:
    """How one projection runs: on our kernel (split > 1: partial sums; glu: gate/up with the
    activation in its epilogue; config None: gemv.pick_config's) or on cuBLAS."""

    ours: bool
    split: int = 1
    glu: bool = False
    config: gemv.ProjConfig | None = None

    def serves(self, rows: int) -> bool:
        """Our kernel runs this projection for `rows` activation rows (else the prefill path does):
        a decode step's and a verification step's rows, which do not see each other."""
        return self.ours and rows <= gemv.MAX_TILED_ROWS


class FusedStages:
    def __init__(self, dec: Decoder, tuning: Tuning, sm_count: int, pdl: bool,
                 smem_per_block: int = H200_SMEM_PER_BLOCK, l2_prefetch_mb: int | None = None) -> None:
        """l2_prefetch_mb: the L2 prefetch budget (None: L2_PREFETCH_MB; 0: no prefetch)."""
        self.dec = dec
        self.smem_per_block = smem_per_block
        self.t = tuning
        self.pdl = pdl
        self.configs = _configs(tuning)
        lw = dec.w.layers[0]
        self.qkv = self._route("qkv", lw.wqkv, lw.bqkv is None, feeds_norm=False, sm_count=sm_count)
        self.o = self._route("o", lw.wo, True, feeds_norm=True, sm_count=sm_count)
        self.gate_up = self._route("gate_up", lw.w_gate_up, True, feeds_norm=False, sm_count=sm_count)
        self.down = self._route("down", lw.w_down, True, feeds_norm=True, sm_count=sm_count)
        self.head_config = self.configs.get("head")
        # the pick's int8 copy of the head (None: the exact kernel picks) and the most rows it picks
        # for (head_pick True forces every head and batch; None only where it pays);
        # the fused stages are the CUDA path, whatever device runs them (tests: Triton's interpreter)
        self.head_int8: head_pick.Int8Head | None = None
        forced = tuning.head_pick is True
        self.head_pick_rows = gemv.MAX_ROWS if forced else head_pick.PAYS_ROWS
        w = dec.w.lm_head
        if tuning.head_pick is not False and not is_quantized(w) and \
                (head_pick.supports(w) if forced else head_pick.pays(w)):
            self.head_int8 = head_pick.quantize(w)
        self.attention_ours = False
        self.rope_in_attention = False
        self._family_ops(dec)
        budget = (L2_PREFETCH_MB if l2_prefetch_mb is None else l2_prefetch_mb) * 2**20
        dev = lw.wo.device
        self.prefetch: list[list[l2_prefetch.Range]] | None = None
        self.lead: list[l2_prefetch.Rows | None] | None = None
        # every layer's o, gate/up and down fit the budget whole: its kernels are latency-bound and
        # HBM idles under them, so piecewise graphs prefetch too (H100, SmolLM2 piecewise 0.737 ->
        # 0.690 ms at batch 1; 1B, whose plan holds o alone: 1.126 -> 1.166; design.md V95)
        self.layers_fit = False
        if budget > 0 and l2_prefetch.supported(dev):
            # per layer, the weights its plan takes whole (l2_prefetch.plan): how many of o, gate/up,
            # down (and the next qkv) decides the piecewise default and where lead tiles go
            fits = [l2_prefetch.fitting(self._prefetched(i), budget) for i in range(len(dec.w.layers))]
            plans = [l2_prefetch.ranges([p for w in f for p in _planes(w)]) for f in fits]
            self.prefetch = plans if any(plans) else None
            whole = [len(f) for f in fits]
            self.layers_fit = all(n >= 3 for n in whole)
            if tuning.l2_prefetch_lead is not False:
                lead_budget = max(budget, LEAD_BUDGET_MB * 2**20)
                lead = [self._lead_tiles(i, lead_budget) if n == 1 else None for i, n in enumerate(whole)]
                self.lead = lead if any(r is not None for r in lead) else None

    def _family_ops(self, dec: Decoder) -> None:
        """What the family models (families.fused_serves) add, prepared once: Qwen3's and Gemma 3's
        per-layer (q_norm, k_norm) [D] for rope_kv_write (None: no q/k norm); the norms' weights
        as add_rms_norm takes them (Gemma: float32 1 + w, one rounding); Gemma's norms after
        attention and after the MLP (None: none), its embedding scale (a value of the model's
        dtype), its GELU(tanh) gate; which RoPE table each layer reads (Decoder.rope_sets, whose
        width is the rotated dims of a head: Phi-3's partial RoPE; LongRoPE's prefill tables are
        Decoder.rope_long)."""
        c, w = dec.cfg, dec.w
        n = len(w.layers)
        self.model_dtype = w.final_norm.dtype
        self.one_round = c.gemma_norms
        prep = fam.gemma_scale if c.gemma_norms else (lambda t: t)
        self.attn_norms = [prep(lw.attn_norm) for lw in w.layers]
        self.mlp_norms = [prep(lw.mlp_norm) for lw in w.layers]
        self.final_norm = prep(w.final_norm)
        self.post_attn: list[torch.Tensor | None] = [None] * n
        self.post_mlp: list[torch.Tensor | None] = [None] * n
        self.qk_norms: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        extra = w.family
        if (c.qk_norm or c.gemma_norms) and (extra is None or len(extra) != n):
            raise ValueError("the family's extra weights are missing")
        if c.qk_norm:
            if any(f.q_norm is None for f in extra):
                raise ValueError("the q/k norm weights are missing")
            self.qk_norms = [(prep(f.q_norm), prep(f.k_norm)) for f in extra]
        if c.gemma_norms:
            self.post_attn = [prep(f.post_attn_norm) for f in extra]
            self.post_mlp = [prep(f.post_mlp_norm) for f in extra]
        scale = fam.embed_scale(c, self.model_dtype, torch.device("cpu"))
        self.embed_scale = None if scale is None else float(scale)
        self.gelu = c.activation == "gelu_tanh"
        self.layer_table = [fam.layer_table(c, i) for i in range(n)]

    def norm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, pdl: bool = False,
             post: torch.Tensor | None = None, in_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """kernels.fused.add_rms_norm with the model's norm: (residual h + delta, its normed rows in
        the model's dtype); `post` norms delta first, in_scale scales h first (Gemma only)."""
        return fk.add_rms_norm(h, delta, w, self.dec.cfg.rms_eps, pdl, self.dec.residual_dtype,
                               out_dtype=self.model_dtype, one_round=self.one_round, delta_norm=post,
                               in_scale=in_scale)

    def layer_input(self, i: int, h: torch.Tensor, delta: torch.Tensor | None, pdl: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's first norm: the residual with the previous layer's MLP output `delta` added
        (layer 0: the embedding rows, scaled where the model scales them) and its normed rows."""
        return self.norm(h, delta, self.attn_norms[i], pdl, post=self.post_mlp[i - 1] if i > 0 else None,
                         in_scale=self.embed_scale if delta is None else None)

    def final_rows(self, h: torch.Tensor, delta: torch.Tensor | None, pdl: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final norm after the last layer's MLP output `delta`: (residual, normed rows)."""
        return self.norm(h, delta, self.final_norm, pdl, post=self.post_mlp[-1] if self.post_mlp else None)

    def _prefetched(self, i: int) -> list[torch.Tensor]:
        """What layer i's attention has prefetched beside it, in order, each whole while they fit
        the budget: its o, gate/up and down, then layer i+1's qkv (H100, SmolLM2 full with the next
        qkv: 0.506 -> 0.491 ms at batch 1; design.md V93)."""
        layers = self.dec.w.layers
        lw = layers[i]
        return [lw.wo, lw.w_gate_up, lw.w_down] + [n.wqkv for n in layers[i + 1:i + 2]]

    def _lead_tiles(self, i: int, lead_budget: int) -> l2_prefetch.Rows | None:
        """For a layer whose plan takes o whole but not gate/up: as many leading K tiles of
        gate/up's kernel as fit what `lead_budget` leaves beside o. Not called where o does not fit
        either: there HBM is busy beside attention (H100, 8B full at batch 8 with four tiles: 5.845
        -> 5.961 ms; design.md V94)."""
        if not self.gate_up.ours or is_quantized(self.dec.w.layers[i].w_gate_up):
            return None
        lw = self.dec.w.layers[i]
        w = lw.w_gate_up
        cfg = self.gate_up.config or gemv.pick_config(w.shape[0] // 2, w.shape[1], True)
        return l2_prefetch.leading_tiles(w, cfg.block_k, lead_budget - l2_prefetch.nbytes(lw.wo))

    def side_work(self, rows: int) -> Callable[[int], None] | None:
        """The L2 prefetch beside attention call i in a graph of `rows` rows, or None: nothing to
        fetch (lead tiles where l2_prefetch_lead is True, or unset and rows >= LEAD_MIN_ROWS)."""
        lead = self.lead
        chosen = self.t.l2_prefetch_lead
        if lead is not None and not (chosen or (chosen is None and rows >= LEAD_MIN_ROWS)):
            lead = None
        if self.prefetch is None and lead is None:
            return None
        ranges = self.prefetch

        def work(i: int) -> None:
            todo: list[l2_prefetch.Range | l2_prefetch.Rows] = list(ranges[i]) if ranges is not None else []
            if lead is not None and lead[i] is not None:
                todo.append(lead[i])
            l2_prefetch.issue(todo)

        return work

    def _route(self, role: str, w: torch.Tensor, bias_free: bool, feeds_norm: bool, sm_count: int) -> Route:
        cfg = self.configs.get(role)
        if is_quantized(w):  # qgemv's tiles; a bias is added after it (before_attention)
            return self._quantized_route(role, w, cfg, feeds_norm, sm_count)
        if not bias_free:
            return Route(False)
        if role == "gate_up":
            n, k = w.shape[0] // 2, w.shape[1]
            if cfg is None and gemv.one_wave_glu(n, k, sm_count, self.smem_per_block):
                cfg = gemv.ONE_WAVE_GLU_TILE
            return Route(True, glu=True, config=cfg)
        # qkv on our kernel at every size where PDL chains the step: its programs let the attention
        # kernel launch early and load its K/V meanwhile, which a library kernel does not (H200,
        # 1B full b1: 0.962 -> 0.929 ms with the attention's preload)
        if role == "qkv" and self.pdl:
            return Route(True, config=cfg)
        # a role given a tile (FGCHAT_PROJ_CONFIGS) runs on our kernel whatever its size
        mine = cfg is not None or gemv.wins_over_cublas(w)
        narrow = feeds_norm and w.shape[0] <= SPLIT_MAX_N
        # Narrow norm-fed outputs: more programs in flight, partial sums left to the norm (H200:
        # 1B o 5.0 -> 4.1 us). Larger ones (1B's and 8B's o and down) take the wide-K tile, one
        # wave of slices.
        if narrow and cfg is None and gemv.wide_k_sized(w) and \
                (split := gemv.wide_k_split(w.shape[0], w.shape[1], sm_count)):
            return Route(True, split, config=gemv.WIDE_K_TILE)
        if cfg is not None and cfg.split and not narrow:
            raise FgchatError(f"FGCHAT_PROJ_CONFIGS: {role}'s outputs ({w.shape[0]}) are too wide to be "
                              f"split along K (at most {SPLIT_MAX_N})")
        if cfg is not None and cfg.split and w.shape[1] % (cfg.split * cfg.block_k):
            raise FgchatError(f"FGCHAT_PROJ_CONFIGS: {role}'s split {cfg.split} does not cut K={w.shape[1]} "
                              f"into whole {cfg.block_k}-wide tiles")
        if narrow and mine:
            split = (cfg.split if cfg is not None and cfg.split
                     else gemv.pick_split(w.shape[0], w.shape[1], sm_count, cfg))
            return Route(True, split, config=cfg)
        return Route(mine, config=cfg)

    @staticmethod
    def _quantized_route(role: str, w: qgemv.QWeight, cfg: gemv.ProjConfig | None, feeds_norm: bool,
                         sm_count: int) -> Route:
        """qgemv's route: its picker's split and tiles, or the role's FGCHAT_PROJ_CONFIGS tile
        (bn, bk, warps, stages; a split for o and down), checked against every part of w."""
        if cfg is not None and cfg.split and not feeds_norm:
            raise FgchatError(f"FGCHAT_PROJ_CONFIGS: {role} cannot be split along K")
        split = (cfg.split if cfg is not None and cfg.split
                 else qgemv.pick_split(w, sm_count) if feeds_norm else 1)
        if cfg is not None:
            try:
                qgemv.check_config(w, quant_config(cfg), split)
            except ValueError as exc:
                raise FgchatError(f"FGCHAT_PROJ_CONFIGS: {role}: {exc}") from None
        return Route(True, split, glu=role == "gate_up", config=cfg)

    def after(self, predecessor_ours: bool) -> bool:
        """PDL for the next launch, whatever precedes it (H200: PDL after library kernels too
        measured no slower); `predecessor_ours` documents the chain at each call site."""
        return self.pdl

    def bind_attention(self, rope_in_attention: bool, attention_ours: bool) -> bool:
        """Record how attention runs; returns PDL for the attention's first kernel. A q/k norm
        keeps RoPE out of attention (rope_kv_write applies the norm), as partial RoPE does (the
        attention kernel rotates whole heads)."""
        partial = self.dec.rope_sets[0][0].shape[-1] != self.dec.cfg.head_dim
        self.rope_in_attention = rope_in_attention and self.qk_norms is None and not partial
        self.attention_ours = attention_ours
        return self.after(self.qkv.ours or not rope_in_attention)

    def _project(self, x: torch.Tensor, w: torch.Tensor, route: Route, predecessor_ours: bool) -> torch.Tensor:
        if not route.serves(x.shape[0]):
            return qgemv.linear(x, w)
        pdl = self.after(predecessor_ours)
        if is_quantized(w):
            if route.split > 1:
                return qgemv.project_partials(x, w, route.split, pdl=pdl, config=quant_config(route.config))
            return qgemv.project(x, w, pdl=pdl, config=quant_config(route.config))
        if route.split > 1:
            return gemv.project_partials(x, w, route.split, route.config, pdl=pdl, preload=PROJ_PRELOAD)
        return gemv.project(x, w, route.config, pdl=pdl, preload=PROJ_PRELOAD)

    # ---- stages (see Decoder for their contracts) ----
    def before_attention(self, i: int, st: StepState, positions: torch.Tensor, slot_ids: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        lw = self.dec.w.layers[i]
        # layer 0 follows the embedding (a torch kernel); later layers the previous down projection
        st.h, x = self.layer_input(i, st.h, st.delta, self.after(i > 0 and self.down.ours))
        st.delta = None
        if lw.bqkv is not None and is_quantized(lw.wqkv):
            qkv = self._project(x, lw.wqkv, self.qkv, True) + lw.bqkv
        elif lw.bqkv is not None:
            qkv = F.linear(x, lw.wqkv, lw.bqkv)
        else:
            qkv = self._project(x, lw.wqkv, self.qkv, True)
        st.qkv = qkv  # an attention call that applies RoPE reads it (a verification step's too)
        if self.rope_in_attention:  # the attention call applies RoPE and writes K/V
            return
        st.q = self.rope_kv_write(i, qkv, positions, slot_ids, k_cache, v_cache, self.after(self.qkv.ours))

    def rope_kv_write(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, pdl: bool = False,
                      k_out: torch.Tensor | None = None, table_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's kernels.fused.rope_kv_write (with its q/k norm where the model has one):
        q [N, Hq, D] of the qkv rows, their K/V written at (slot, position). table_rows
        (prefill_table_rows): each row's row of the LongRoPE prefill tables."""
        c, j = self.dec.cfg, self.layer_table[i]
        table_rows = table_rows if j == 0 else None  # LongRoPE's long rows are the global table's
        cos, sin = self.dec.rope_sets[j] if table_rows is None else self.dec.rope_long
        return fk.rope_kv_write(qkv, cos, sin, positions, slots, k_cache, v_cache, c.num_heads,
                                c.num_kv_heads, c.head_dim, pdl, k_out=k_out,
                                qk_norm=None if self.qk_norms is None else self.qk_norms[i], norm_eps=c.rms_eps,
                                norm_one_round=self.one_round, table_rows=table_rows)

    def prefill_table_rows(self, pos: torch.Tensor, spans: list[tuple[int, int]] | None, batch: int,
                           after: tuple[int, int] | None, keep: torch.Tensor | None) -> torch.Tensor | None:
        """LongRoPE: each row of a fused prefill (prefill._fused_layers, its arguments) as a row of
        Decoder.rope_long: its position, plus the table's length where its prompt ends past the original
        context (then every row of that prompt takes the long factors, as the plain stages and
        transformers prefill it). Prompt ends: after's first + rows; per span; else each of the
        `batch` equal blocks ends after its row in keep (device indices, no host sync), or at its
        last row. None without LongRoPE."""
        long = self.dec.rope_long
        if long is None:
            return None
        n, cut, length = pos.shape[0], fam.longrope_cut(self.dec.cfg), long[0].shape[0] // 2
        if after is not None:
            return pos + length if after[1] + n > cut else pos
        if spans is not None:
            lift = torch.cat([torch.full((t,), length if t > cut else 0, dtype=torch.int64) for _, t in spans])
            return pos + lift.to(pos.device, non_blocking=True)
        t = n // batch
        if keep is None:
            return pos + length if t > cut else pos
        ends = keep - torch.arange(batch, device=pos.device) * t + 1  # prompt j's last row is keep[j]
        return pos + ((ends > cut).to(torch.int64) * length)[:, None].expand(batch, t).reshape(n)

    def after_attention(self, i: int, st: StepState, attn_out: torch.Tensor) -> None:
        lw = self.dec.w.layers[i]
        o = self._project(attn_out.view(attn_out.shape[0], -1), lw.wo, self.o, self.attention_ours)
        st.h, x = self.norm(st.h, o, self.mlp_norms[i], self.after(self.o.ours), post=self.post_attn[i])
        if self.gate_up.glu and self.gate_up.serves(x.shape[0]) and is_quantized(lw.w_gate_up):
            act = qgemv.project_glu(x, lw.w_gate_up, pdl=self.after(True), config=quant_config(self.gate_up.config),
                                    gelu=self.gelu)
        elif self.gate_up.glu and self.gate_up.serves(x.shape[0]):
            act = gemv.project_glu(x, lw.w_gate_up, self.gate_up.config, pdl=self.after(True), gelu=self.gelu)
        else:
            gu = self._project(x, lw.w_gate_up, self.gate_up, True)
            act = fk.silu_mul(gu, self.after(self.gate_up.serves(x.shape[0])), gelu=self.gelu)
        st.delta = self._project(act, lw.w_down, self.down, True)

    def head(self, st: StepState, greedy: bool,
             sample: gemv.SampleArgs | None = None) -> None:
        dec = self.dec
        st.h, x = self.final_rows(st.h, st.delta, self.after(self.down.ours))
        st.delta = None
        quantized = is_quantized(dec.w.lm_head)
        if (greedy or sample is not None) and x.shape[0] <= gemv.MAX_TILED_ROWS:
            sample = None if greedy else sample
            if quantized:
                st.logits, st.tokens = qgemv.project_argmax(x, dec.w.lm_head, pdl=self.after(True), sample=sample,
                                                            config=quant_config(self.head_config))
            elif self.picks_from_int8(x.shape[0]):  # logits exact only where rescored
                st.logits, st.tokens = head_pick.pick(x, dec.w.lm_head, self.head_int8, self.head_config,
                                                      pdl=self.after(True), sample=sample)
            else:
                st.logits, st.tokens = gemv.project_argmax(x, dec.w.lm_head, self.head_config,
                                                           pdl=self.after(True), sample=sample)
        else:
            st.logits = self.logits(x)

    @contextlib.contextmanager
    def exact_head(self) -> Iterator[None]:
        """Eager steps run inside pick with the exact LM head kernel (graphs keep what they captured)."""
        saved, self.head_int8 = self.head_int8, None
        try:
            yield
        finally:
            self.head_int8 = saved

    def picks_from_int8(self, rows: int) -> bool:
        """The head's pick for `rows` rows comes from its int8 copy (Tuning.head_pick)."""
        return self.head_int8 is not None and rows <= self.head_pick_rows

    def pick_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, V] of normed rows x from the int8 pick: each row's argmax is the exact
        head's (head_pick's invariants), the other logits within its bound; None where the pick
        does not serve N rows (then `logits`)."""
        if not self.picks_from_int8(x.shape[0]):
            return None
        logits, _ = head_pick.pick(x, self.dec.w.lm_head, self.head_int8, self.head_config, pdl=self.after(True))
        return logits

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, V] of normed rows x: our kernel for up to MAX_TILED_ROWS rows, else cuBLAS."""
        w = self.dec.w.lm_head
        if is_quantized(w):
            return quant_ops.logits(x, w, pdl=self.after(True))
        if x.shape[0] <= gemv.MAX_TILED_ROWS:
            return gemv.project_logits(x, w, self.head_config, pdl=self.after(True))
        return self.dec.head_logits(x)


def _planes(w: torch.Tensor | object) -> list[torch.Tensor]:
    """The tensors a weight's bytes live in: a dense weight itself, a quantized one's planes."""
    if not is_quantized(w):
        return [w]
    parts = getattr(w, "parts", [w])
    return [p for part in parts for p in part.planes.values()]


def quant_config(cfg: gemv.ProjConfig | None) -> qgemv.QConfig | None:
    """A role's FGCHAT_PROJ_CONFIGS tile as qgemv's (its swap does not apply there)."""
    return None if cfg is None else qgemv.QConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)


def _configs(tuning: Tuning) -> dict[str, gemv.ProjConfig]:
    """Tile overrides per projection role (FGCHAT_PROJ_CONFIGS); a malformed one is a user error."""
    try:
        configs = {role: gemv.ProjConfig.parse(text) for role, text in tuning.proj_config_texts().items()}
    except ValueError as exc:
        raise FgchatError(str(exc)) from None
    for role, cfg in configs.items():
        if cfg.split and role not in SPLIT_ROLES:
            raise FgchatError(f"FGCHAT_PROJ_CONFIGS: {role} cannot be split along K (only "
                              f"{' and '.join(SPLIT_ROLES)}, whose partial sums the next norm adds)")
    return configs
