"""Our decoder (Llama / Qwen2 / Mistral families), written as explicit stages.

A decode step is: embed -> per layer [before_attention, attention, after_attention] -> head.
Eager calls the stages; piecewise/full CUDA graphs capture the same calls, so all modes launch
the same kernels in the same order and stay bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from fgchat.protocol.errors import ModelLoadError
from fgchat.engine.model.config import ModelConfig, rope_inv_freq
from fgchat.engine.model.cpu_head_pick import CpuHeadPick
from fgchat.engine.model.cpu_linear import PackedProjections, role_weight
from fgchat.engine.model.families import (
    FamilyLayerWeights, attention_scale, fused_serves, layer_window, normalize_state_dict,
    prefill_table, random_family_weights, rope_tables, take_family_weights, uses_family_stages,
)
from fgchat.engine.model import quant_ops
from fgchat.engine.model.ops import CpuHead, apply_rope_rolled, rms_norm, signed_sin
from fgchat.engine.quant.qweight import QuantStack, QuantWeight
from fgchat.protocol.tuning import Tuning

if TYPE_CHECKING:
    from fgchat.engine.kernels.gemv import SampleArgs
    from fgchat.engine.model.fused_step import FusedStages


@dataclass
class LayerWeights:
    """A layer's weights. The projections may be quantized (quant.qweight; a CUDA model's GGUF
    blocks or --quantize) and are then [N, K] logically; norms and biases are plain."""

    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor | QuantWeight | QuantStack  # [q + 2*kv, H], rows q | k | v
    bqkv: torch.Tensor | None  # [q + 2*kv]
    wo: torch.Tensor | QuantWeight | QuantStack  # [H, q]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor | QuantWeight | QuantStack  # [2*I, H], rows gate | up
    w_down: torch.Tensor | QuantWeight | QuantStack  # [H, I]


@dataclass
class DecoderWeights:
    embed: torch.Tensor | QuantWeight  # [V, H]; quantized where a GGUF file quantizes it (CUDA)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]; its dtype is the model's
    lm_head: torch.Tensor | QuantWeight  # [V, H]; the same object as embed when tied
    family: list[FamilyLayerWeights] | None = None  # Qwen3 / Gemma 3 / Phi-3's extra weights (model.families)


def weights_from_state_dict(
    cfg: ModelConfig, sd: dict[str, torch.Tensor | QuantWeight], device: torch.device, dtype: torch.dtype
) -> DecoderWeights:
    """Map HF parameter names to fused decoder weights; missing tensors raise ModelLoadError.
    Quantized entries stay quantized (model.quant_weights.fuse)."""
    from fgchat.engine.model.quant_weights import fuse

    def take(name: str) -> torch.Tensor | QuantWeight:
        t = sd.pop(name, None)
        if t is None:
            raise ModelLoadError(f"weights are missing tensor '{name}'")
        return t

    def put(*ts: torch.Tensor | QuantWeight):
        return fuse(list(ts), device, dtype)

    normalize_state_dict(cfg, sd)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        if tuple(q.shape) != (cfg.q_size, cfg.hidden_size) or tuple(k.shape) != (cfg.kv_size, cfg.hidden_size):
            raise ModelLoadError(f"layer {i}: attention weight shapes do not match config.json")
        bias = None
        if cfg.qkv_bias:
            bias = put(*(take(p + f"self_attn.{n}_proj.bias") for n in "qkv"))
        layers.append(
            LayerWeights(
                attn_norm=put(take(p + "input_layernorm.weight")),
                wqkv=put(q, k, v),
                bqkv=bias,
                wo=put(take(p + "self_attn.o_proj.weight")),
                mlp_norm=put(take(p + "post_attention_layernorm.weight")),
                w_gate_up=put(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")),
                w_down=put(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = put(take("model.embed_tokens.weight"))
    if embed.shape[0] != cfg.vocab_size:
        raise ModelLoadError("embedding size does not match vocab_size in config.json")
    head = sd.pop("lm_head.weight", None)
    lm_head = embed if (cfg.tie_embeddings or head is None) else put(head)
    family = take_family_weights(cfg, sd, put)
    return DecoderWeights(embed, layers, put(take("model.norm.weight")), lm_head, family)


OUTLIER_CHANNELS = 4


def random_weights(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0, outliers: float = 0.0
) -> DecoderWeights:
    """Random weights of the config's shapes, generated on the device (for benchmarks).

    outliers > 0 gives the residual stream "massive activations" as real models carry them
    (SmolLM2-135M: ~2.5e4 in one channel): OUTLIER_CHANNELS channels of every embedding row hold
    values from outliers/6 up to outliers (alternating signs), the other channels are of unit
    scale, the norms damp the outlier channels (weight 0.01, as trained models learn) and the
    LM head is untied. Random weights of std 0.02 alone never produce such channels.
    """
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    layers = [
        LayerWeights(
            attn_norm=ones(h),
            wqkv=rnd(qkv, h),
            bqkv=rnd(qkv) if cfg.qkv_bias else None,
            wo=rnd(h, cfg.q_size),
            mlp_norm=ones(h),
            w_gate_up=rnd(2 * cfg.intermediate_size, h),
            w_down=rnd(h, cfg.intermediate_size),
        )
        for _ in range(cfg.num_layers)
    ]
    embed = rnd(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_embeddings else rnd(cfg.vocab_size, h)
    final_norm = ones(h)
    if outliers > 0:
        chans = outlier_channels(h)
        vals = torch.linspace(outliers / 6, outliers, len(chans), device=device)
        vals = vals * torch.tensor([(-1.0) ** i for i in range(len(chans))], device=device)
        embed = (torch.randn(cfg.vocab_size, h, generator=g, device=device) + 0.0)
        embed[:, chans] = vals
        embed = embed.to(dtype)
        lm_head = rnd(cfg.vocab_size, h)
        for lw in layers:
            lw.attn_norm[chans] = 0.01
            lw.mlp_norm[chans] = 0.01
        final_norm[chans] = 0.01
    return DecoderWeights(embed, layers, final_norm, lm_head, random_family_weights(cfg, device, dtype))


def outlier_channels(hidden: int) -> list[int]:
    """The residual channels random_weights(outliers=...) makes massive (spread over the row)."""
    return [(hidden // OUTLIER_CHANNELS) * i + 7 for i in range(OUTLIER_CHANNELS)]


AttentionFn = Callable[..., None]


class StepState:
    """Tensors flowing between decode stages. Under graph capture these become graph outputs."""

    h: torch.Tensor  # residual stream [B, H]
    delta: torch.Tensor | None = None  # fused path: MLP output not yet added to h
    q: torch.Tensor  # query of the current layer [B, Hq, D]
    qkv: torch.Tensor  # with rope_in_attention: the layer's q | k | v rows before RoPE
    logits: torch.Tensor  # [B, V] float32
    tokens: torch.Tensor | None = None  # [B] int64 picks, when head(greedy=True or sample=...) made them
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # plain path: this step's cos, signed sin rows


class Decoder:
    """Holds weights, RoPE tables and the decode/prefill stages. No per-step host syncs."""

    def __init__(
        self, cfg: ModelConfig, weights: DecoderWeights, max_context: int, fused: bool = False,
        tuning: Tuning | None = None,
    ) -> None:
        """fused=True runs decode stages with the Triton kernels of fgchat.engine.kernels.fused (CUDA);
        `tuning` holds the rules tests may force (protocol.tuning)."""
        self.cfg = cfg
        self.fused = fused
        t = tuning or Tuning()
        self.w = weights
        self.pdl = False
        self._fused: FusedStages | None = None
        if fused:
            from fgchat.engine.model import fused_step
            from fgchat.engine.kernels.pdl import supported

            dev = weights.embed.device
            self.pdl = supported(dev)
            # SM count sizes split-K and shared memory bounds tiles; a CPU decoder (tests, Triton's
            # interpreter) takes the H200's
            sms, smem = 132, fused_step.H200_SMEM_PER_BLOCK
            if dev.type == "cuda":
                props = torch.cuda.get_device_properties(dev)
                sms, smem = props.multi_processor_count, props.shared_memory_per_block_optin
            self._fused = fused_step.FusedStages(self, t, sms, self.pdl, smem)
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        # the fused path's residual stream is float32: bf16 rounds a massive activation channel
        # (~2.5e4) by up to 64 per add; the plain path keeps the model's dtype, as HF does
        self.residual_dtype = torch.float32 if fused else self.dtype
        self.max_context = max_context
        self.scale = cfg.head_dim**-0.5
        self.layer_windows: list[int] | None = None  # per layer: attend to the last n positions (0: all)
        # LongRoPE's fused prefill tables (families.prefill_table; FusedStages.prefill_table_rows)
        self.rope_long: tuple[torch.Tensor, torch.Tensor] | None = None
        if fused_serves(cfg):  # a family model the fused stages serve: the plain stages' tables
            tables = [(c.to(self.device, self.dtype), s.to(self.device, self.dtype))
                      for c, s in rope_tables(cfg, max_context)]
            long = prefill_table(cfg, max_context) if fused else None
            self.rope_long = None if long is None else (long[0].to(self.device, self.dtype),
                                                        long[1].to(self.device, self.dtype))
            cos, sin = tables[0]
            if fused:
                self.scale = attention_scale(cfg)
                self.layer_windows = [layer_window(cfg, i) for i in range(cfg.num_layers)] \
                    if any(cfg.layer_windows) else None
        else:
            inv = torch.tensor(rope_inv_freq(cfg), dtype=torch.float32, device=self.device)
            pos = torch.arange(max_context, dtype=torch.float32, device=self.device)
            freqs = pos[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
            tables = [(cos, sin)]
        self.cos = cos  # [T, D]
        self.sin = sin
        # the fused path's RoPE tables: [global] or [global, local] (families.layer_table)
        self.rope_sets: list[tuple[torch.Tensor, torch.Tensor]] = tables
        self.ssin = signed_sin(self.sin)  # the plain decode path's rotation (ops.apply_rope_rolled)
        cpu = self.device.type == "cpu"
        # the LM head on CPU, packed where it can be
        dense_head = isinstance(weights.lm_head, torch.Tensor)  # else quantized: FusedStages.logits
        self._cpu_head = CpuHead(weights.lm_head) if cpu and dense_head else None
        # greedy picks on CPU from a packed bf16 copy of the head (Tuning.head_pick; None: CpuHead)
        self._cpu_pick = CpuHeadPick.prepare(weights.lm_head) if cpu and not fused and t.head_pick is not False else None
        # the plain path's projections on CPU through oneDNN's packed weights (None: F.linear)
        self._packed = PackedProjections.prepare(weights) if cpu and not fused else None
        # Qwen3 / Gemma 3 / Phi-3: model.family_stages replaces the stages below (and sets scale
        # and layer_windows), except where the fused stages serve the family (families.fused_serves)
        self.family = None
        if uses_family_stages(cfg, fused):
            from fgchat.engine.model.family_stages import FamilyStages

            FamilyStages(self).install()

    # ---- decode stages (batch of B sequences, one token each) ----
    @property
    def fused_stages(self) -> FusedStages | None:
        """The fused path's stages (CUDA + Triton); None on plain torch ops."""
        return self._fused

    @property
    def rope_in_attention(self) -> bool:
        """True when the attention call applies RoPE and writes K/V (see bind_attention)."""
        return self._fused is not None and self._fused.rope_in_attention

    @contextlib.contextmanager
    def kv_written_in_stages(self) -> Iterator[None]:
        """Stages run inside write every row's K/V in before_attention, also where the attention
        call would apply RoPE and write them itself (rows of one slot that attend to each other's
        K/V need them written before the call)."""
        fused = self._fused
        if fused is None or not fused.rope_in_attention:
            yield
            return
        fused.rope_in_attention = False
        try:
            yield
        finally:
            fused.rope_in_attention = True

    def bind_attention(self, rope_in_attention: bool, attention_is_triton: bool) -> bool:
        """Fused path: record how the attention call runs. Returns whether the attention's first
        kernel may use programmatic dependent launch."""
        if self._fused is None:
            return False
        return self._fused.bind_attention(rope_in_attention, attention_is_triton)

    @property
    def piecewise_prefetch(self) -> bool:
        """Piecewise graphs fork side_work(rows)(i) at layer i's first stage (Tuning.piecewise_prefetch;
        None: where every layer's o, gate/up and down fit the L2 budget whole)."""
        if self._fused is None:
            return False
        chosen = self._fused.t.piecewise_prefetch
        return self._fused.layers_fit if chosen is None else chosen

    def side_work(self, rows: int) -> Callable[[int], None] | None:
        """Work a whole-step graph of `rows` rows may run beside attention call i, on a side
        branch that joins at the end of the step (an L2 weight prefetch: it changes no result);
        piecewise graphs with piecewise_prefetch run it from layer i's first stage. None: nothing."""
        return self._fused.side_work(rows) if self._fused is not None else None

    def embed(self, st: StepState, input_ids: torch.Tensor) -> None:
        st.h = quant_ops.embedding(input_ids, self.w.embed)
        st.delta = None

    def before_attention(
        self,
        i: int,
        st: StepState,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Norm, QKV, RoPE and the KV-cache write of the current token at (slot, position)."""
        if self._fused is not None:
            self._fused.before_attention(i, st, positions, slot_ids, k_cache, v_cache)
            return
        c, lw = self.cfg, self.w.layers[i]
        x = rms_norm(st.h, lw.attn_norm, c.rms_eps)
        qkv = self.project(x, i, "qkv")
        n = x.shape[0]
        if i == 0 or st.rope is None:  # every layer of a step rotates by the same positions
            st.rope = (self.cos[positions], self.ssin[positions])
        # q and k heads are adjacent in each qkv row: one rotation for both
        qk = apply_rope_rolled(qkv[:, : c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim),
                               *st.rope)
        st.q = qk[:, : c.num_heads]
        k_cache[slot_ids, positions] = qk[:, c.num_heads:]
        v_cache[slot_ids, positions] = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)

    def after_attention(self, i: int, st: StepState, attn_out: torch.Tensor) -> None:
        """Output projection, residual, norm, gated MLP, residual."""
        if self._fused is not None:
            self._fused.after_attention(i, st, attn_out)
            return
        c, lw = self.cfg, self.w.layers[i]
        h = st.h + self.project(attn_out.view(attn_out.shape[0], -1), i, "o")
        x = rms_norm(h, lw.mlp_norm, c.rms_eps)
        gu = self.project(x, i, "gate_up")
        g, u = gu.chunk(2, dim=-1)
        st.h = h + self.project(F.silu(g) * u, i, "down")

    @property
    def pads_prefill_rows(self) -> bool:
        """A plain prefill pads its rows to prefill.cpu_prefill_rows' sizes: on CPU wherever the
        products go through oneDNN (half dtypes; float32 with packed projections)."""
        return self.device.type == "cpu" and (self.dtype != torch.float32 or self._packed is not None)

    def project(self, x: torch.Tensor, i: int, role: str) -> torch.Tensor:
        """The plain path's product of x with layer i's `role` weight (qkv with its bias, if
        any): oneDNN's packed copy where the decoder prepared one (CPU), else F.linear."""
        lw = self.w.layers[i]
        bias = lw.bqkv if role == "qkv" else None
        if self._packed is not None:
            return self._packed.linear(x, i, role, bias)
        return quant_ops.linear(x, role_weight(lw, role), bias)

    def head(self, st: StepState, greedy: bool = False,
             sample: SampleArgs | None = None) -> None:
        """Final norm and LM head: st.logits. greedy=True lets the fused path also set st.tokens
        (torch.argmax's pick) in the LM head's own launches; sample = (temperature, seeds,
        positions) lets it set the unfiltered sampled pick (sampling.sample(filtered=False)'s)."""
        if self._fused is not None:
            self._fused.head(st, greedy, sample)
            return
        x = rms_norm(st.h, self.w.final_norm, self.cfg.rms_eps)
        if greedy and self._cpu_pick is not None:
            st.logits, st.tokens = self._cpu_pick.pick(x)
        else:
            st.logits = self.head_logits(x)

    @property
    def picks_approximately(self) -> bool:
        """Greedy steps pick from a low-precision copy of the LM head (Tuning.head_pick): their
        logits are exact only for the rows they rescored."""
        return self._cpu_pick is not None or (self._fused is not None and self._fused.head_int8 is not None)

    @contextlib.contextmanager
    def exact_head(self) -> Iterator[None]:
        """Eager steps run inside compute every logit exactly (graphs keep what they captured)."""
        saved = self._cpu_pick
        self._cpu_pick = None
        try:
            if self._fused is not None:
                with self._fused.exact_head():
                    yield
            else:
                yield
        finally:
            self._cpu_pick = saved

    def norm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of residual rows h: the final norm, then head_logits."""
        return self.head_logits(rms_norm(h, self.w.final_norm, self.cfg.rms_eps))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of normed rows x (ops.head_logits; on CPU, the decoder's prepared
        CpuHead)."""
        if self._cpu_head is not None:
            return self._cpu_head(x)
        if self._fused is not None and not isinstance(self.w.lm_head, torch.Tensor):
            return self._fused.logits(x)
        return quant_ops.logits(x, self.w.lm_head)

    # ---- prefill (one sequence, eager) ----
    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        slot: int,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        all_logits: bool = False,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Run the prompt `ids` [T] into cache slot `slot` at positions 0..T-1.

        Returns the last position's logits [V] (float32), or [T, V] with all_logits. greedy: the
        last logits serve an argmax only (where the int8 pick serves, only their argmax is exact).
        """
        from fgchat.engine.model.prefill import prefill

        return prefill(self, ids, slot, k_caches, v_caches, all_logits, greedy)
