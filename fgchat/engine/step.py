"""Decode-step inputs in fixed-address buffers, and the step body as an ordered list of pieces.

Invariants:
- Every tensor a step reads from the host lives in `StepBuffers` at an address fixed for the
  engine's lifetime; CUDA graphs captured over them stay valid, and lanes [0, B) are rewritten in
  place before every step of batch size B (lanes >= B are never read by a size-B step).
- `StepProgram.pieces(B)` is the only definition of a decode step. Eager runs the pieces and the
  attentions between them; piecewise captures each piece; full captures all of it. Same kernels,
  same order, so every mode yields the same bits.
- A verification step (speculative decoding) is the same step over B x block rows, `pieces(B,
  block=k + 1)`: row (b, j) is sequence b's token at position len_b - 1 + j of its slot. Every
  row's K/V is written before attention reads (by the stages: inside the attention call alone, rows
  of one slot would race), and each row attends up to its own position (length = position + 1),
  so the causal mask inside a block falls out of the per-row lengths. Each row computes the bits
  of the plain step of that row: the same kernels with the same constants (where RoPE runs inside
  attention, it runs there for a block too, the call rewriting each row's K/V with the bits the
  stages wrote), attention's partition independent of the row count, projections and LM head
  on kernels whose rows do not see each other (kernels.gemv).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Callable

import torch

from fgchat.engine.kernels import penalties, sampling
from fgchat.engine.kernels.attention.base import DecodeAttention
from fgchat.engine.kv_cache import NUM_SLOTS, KVCache
from fgchat.engine.model.decoder import Decoder, StepState
from fgchat.engine.speculate import MAX_DRAFT_LEN

if TYPE_CHECKING:
    from fgchat.engine.kernels.megakernel import DecodeLayers

# rows of the packed int64 staging tensor
ROW_IDS, ROW_POS, ROW_SLOT, ROW_SEED, ROW_TOPK = range(5)
N_INT_ROWS = 5
# rows of the packed float32 staging tensor
ROW_TEMP, ROW_TOPP, ROW_REP, ROW_PRES, ROW_FREQ = range(5)
N_FLOAT_ROWS = 5
# lanes of the step buffers: a verification step's rows, B sequences x (k + 1) at most
MAX_ROWS = NUM_SLOTS * (MAX_DRAFT_LEN + 1)


class Variant(IntEnum):
    """What the step's last piece does with the logits, as flags (1 sampled, 2 penalized, 4 top-k /
    top-p filtered). A batch runs the most general variant any of its lanes needs; the others'
    lanes are unaffected (temperature 0 is greedy, penalties 1 / 0 / 0 keep logits bit for bit,
    top-p 1 and top-k 0 drop nothing in the filtered variant). False / True stand for GREEDY /
    SAMPLED."""

    GREEDY = 0  # argmax (fused into the LM head where our kernel runs it)
    SAMPLED = 1  # temperature (Gumbel-max over the whole vocabulary: no sort)
    PENALIZED = 2  # repetition / presence / frequency penalties, then argmax; counts recorded
    PENALIZED_SAMPLED = 3  # penalties, then as SAMPLED; counts recorded
    SAMPLED_FILTERED = 5  # temperature, top-k, top-p (one sort of the logits)
    PENALIZED_SAMPLED_FILTERED = 7  # penalties, then as SAMPLED_FILTERED; counts recorded

    @classmethod
    def of(cls, penalized: bool, sampled: bool, filtered: bool = False) -> Variant:
        return cls(int(sampled) | 2 * int(penalized) | 4 * int(sampled and filtered))

    @property
    def sampled(self) -> bool:
        return bool(self & 1)

    @property
    def penalized(self) -> bool:
        return bool(self & 2)

    @property
    def filtered(self) -> bool:
        return bool(self & 4)


class StepBuffers:
    """Host staging (pinned on CUDA) and device buffers for up to MAX_ROWS lanes (a decode step
    uses one per sequence, a verification step k + 1)."""

    def __init__(self, device: torch.device, num_heads: int, head_dim: int, dtype: torch.dtype):
        pin = device.type == "cuda"
        self.host_i = torch.zeros((N_INT_ROWS, MAX_ROWS), dtype=torch.int64, pin_memory=pin)
        self.host_f = torch.zeros((N_FLOAT_ROWS, MAX_ROWS), dtype=torch.float32, pin_memory=pin)
        self.dev_i = torch.zeros((N_INT_ROWS, MAX_ROWS), dtype=torch.int64, device=device)
        self.dev_f = torch.zeros((N_FLOAT_ROWS, MAX_ROWS), dtype=torch.float32, device=device)
        # int32 views the attention kernels read: row 0 = seq_lens, row 1 = slot ids
        self.dev_i32 = torch.zeros((2, MAX_ROWS), dtype=torch.int32, device=device)
        self.attn_out = torch.zeros((MAX_ROWS, num_heads, head_dim), dtype=dtype, device=device)
        self.device = device
        self._np_i = self.host_i.numpy()
        self._np_f = self.host_f.numpy()

    def stage(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        temps: list[float],
        top_ps: list[float],
        top_ks: list[int],
        seeds: list[int],
        reps: list[float] | None = None,
        presences: list[float] | None = None,
        frequencies: list[float] | None = None,
    ) -> None:
        """Write lanes [0, B) on the host and copy them to the device (async on CUDA).

        Rewriting the pinned staging memory is safe: every step ends with a host sync on its
        sampled tokens, so the previous step's asynchronous copies have completed.
        """
        b = len(ids)
        hi, hf = self._np_i, self._np_f  # numpy views of the host staging tensors
        hi[:, b:] = 0
        hf[:, b:] = 0
        hi[ROW_IDS, :b] = ids
        hi[ROW_POS, :b] = positions
        hi[ROW_SLOT, :b] = slots
        hi[ROW_SEED, :b] = seeds
        hi[ROW_TOPK, :b] = top_ks
        hf[ROW_TEMP, :b] = temps
        hf[ROW_TOPP, :b] = top_ps
        hf[ROW_REP, :b] = reps if reps is not None else 1.0
        hf[ROW_PRES, :b] = presences if presences is not None else 0.0
        hf[ROW_FREQ, :b] = frequencies if frequencies is not None else 0.0
        hi, hf = self.host_i, self.host_f
        self.dev_i.copy_(hi, non_blocking=True)
        self.dev_f.copy_(hf, non_blocking=True)


@dataclass
class StepOutputs:
    tokens: torch.Tensor  # [B] int64
    # [B, V] float32; where the decoder picks approximately (Decoder.picks_approximately) a greedy
    # step's logits are exact only for the rows it rescored
    logits: torch.Tensor


Piece = Callable[[StepState], None]


class StepProgram:
    """Builds the pieces of a decode step for a batch size over shared buffers and cache."""

    def __init__(self, decoder: Decoder, cache: KVCache, bufs: StepBuffers, attention: DecodeAttention) -> None:
        self.dec = decoder
        self.cache = cache
        self.bufs = bufs
        self.attention = attention
        # per-slot token counts and prompt-id masks read by the PENALIZED variant (kernels.penalties)
        self.counts, self.prompt_mask = penalties.alloc_state(NUM_SLOTS, decoder.cfg.vocab_size, bufs.device)
        # host-side bound of seq_lens for eager CPU steps (lets the torch backend slice the cache)
        self.max_len_hint: int | None = None

    def pieces(self, b: int, variant: int, before_layer: Callable[[int], None] | None = None, block: int = 1
               ) -> tuple[list[Piece], list[Callable[[StepState], None]]]:
        """Returns (pieces, attentions): run pieces[0], attentions[0], pieces[1], ..., pieces[L].

        Each attention reads st.q as left by the preceding piece and writes bufs.attn_out[:rows]
        (rows = b * block). `before_layer(i)`, if given, runs in the piece that ends at attention
        i, right before layer i's first stage (piecewise graphs fork their L2 prefetch there).
        block > 1: a verification step (module docstring); its last piece leaves logits at every
        row and each row's pick (`_finish_block`).
        """
        variant = Variant(variant)
        dec, bufs, cache = self.dec, self.bufs, self.cache
        rows = b * block
        di, i32 = bufs.dev_i, bufs.dev_i32
        ids, pos, slots = di[ROW_IDS, :rows], di[ROW_POS, :rows], di[ROW_SLOT, :rows]
        seq_lens, slots32 = i32[0, :rows], i32[1, :rows]
        attn_out = bufs.attn_out[:rows]
        n_layers = dec.cfg.num_layers
        rope_in_attention = dec.rope_in_attention and self.attention.rope_in_attention
        attention = self.attention if block == 1 else self.attention.for_blocks()

        def before(i: int, st: StepState) -> None:
            if block == 1:
                dec.before_attention(i, st, pos, slots, cache.k[i], cache.v[i])
                return
            with dec.kv_written_in_stages():  # rows of one slot read each other's K/V
                dec.before_attention(i, st, pos, slots, cache.k[i], cache.v[i])

        def first(st: StepState) -> None:
            if dec.fused and is_quantized(dec.w.embed):
                st.h, st.delta = qtiles.step_inputs(ids, pos, slots, dec.w.embed, seq_lens, slots32), None
            elif dec.fused:
                st.h, st.delta = fused_ops.step_inputs(ids, pos, slots, dec.w.embed, seq_lens, slots32), None
            else:
                seq_lens.copy_(pos + 1)
                slots32.copy_(slots)
                dec.embed(st, ids)
            if before_layer is not None:
                before_layer(0)
            before(0, st)

        def middle(i: int) -> Piece:
            def run(st: StepState) -> None:
                dec.after_attention(i - 1, st, attn_out)
                if before_layer is not None:
                    before_layer(i)
                before(i, st)

            return run

        def last(st: StepState) -> None:
            dec.after_attention(n_layers - 1, st, attn_out)
            if block == 1:
                self._finish(st, b, variant)
            else:
                self._finish_block(st, variant)

        def attend(i: int) -> Callable[[StepState], None]:
            if rope_in_attention:
                def run_rope(st: StepState) -> None:
                    attention.decode_with_rope(*self._attention_args(i, st, seq_lens, slots32, attn_out, True))

                return run_rope

            window = dec.layer_windows[i] if dec.layer_windows else 0
            if window:  # a windowed layer (model.families): the backend starts at len - window
                def run_window(st: StepState) -> None:
                    hint = self.max_len_hint if bufs.device.type == "cpu" else None
                    attention(*self._attention_args(i, st, seq_lens, slots32, attn_out), hint, window=window)

                return run_window

            def run(st: StepState) -> None:
                hint = self.max_len_hint if bufs.device.type == "cpu" else None
                attention(*self._attention_args(i, st, seq_lens, slots32, attn_out), hint)

            return run

        fused_ops = qtiles = None
        if dec.fused:
            from fgchat.engine.kernels import fused as fused_ops
            from fgchat.engine.kernels import qtiles
            from fgchat.engine.kernels.qtiles import is_quantized
        pieces = [first] + [middle(i) for i in range(1, n_layers)] + [last]
        return pieces, [attend(i) for i in range(n_layers)]

    def mega_pieces(self, b: int, variant: int, layers: DecodeLayers) -> list[Piece]:
        """The step as the mega mode runs it: one piece, every decoder layer in one persistent
        launch (`layers`), then the same last stage as `pieces`."""
        variant = Variant(variant)
        di = self.bufs.dev_i
        ids, pos, slots = di[ROW_IDS, :b], di[ROW_POS, :b], di[ROW_SLOT, :b]

        def whole(st: StepState) -> None:
            st.h, st.delta = layers.run(ids, pos, slots), None
            self._finish(st, b, variant)

        return [whole]

    def _finish(self, st: StepState, b: int, variant: Variant) -> None:
        """The step's last stage after the final layer left st.h (and st.delta): final norm, LM
        head, penalties and the pick into st.tokens."""
        dec, bufs = self.dec, self.bufs
        di, df = bufs.dev_i, bufs.dev_f
        pos, slots = di[ROW_POS, :b], di[ROW_SLOT, :b]
        penalized = variant.penalized
        next_pos = pos + 1 if variant.sampled else None  # the position the noise is drawn for
        # the LM head may pick the tokens itself: greedy, or sampled without filters or penalties
        head_sample = (df[ROW_TEMP, :b], di[ROW_SEED, :b], next_pos) if variant == Variant.SAMPLED else None
        dec.head(st, greedy=variant == Variant.GREEDY, sample=head_sample)
        if penalized:
            penalties.apply_penalties(st.logits, self.counts, self.prompt_mask, slots,
                                      df[ROW_REP, :b], df[ROW_PRES, :b], df[ROW_FREQ, :b])
        if variant.sampled and st.tokens is None:
            st.tokens = sampling.sample(
                st.logits, df[ROW_TEMP, :b], df[ROW_TOPP, :b], di[ROW_TOPK, :b],
                di[ROW_SEED, :b], next_pos, filtered=variant.filtered,
            )
        elif st.tokens is None:
            st.tokens = sampling.greedy(st.logits)
        if penalized:
            penalties.record_tokens(self.counts, slots, st.tokens)

    def _finish_block(self, st: StepState, variant: Variant) -> None:
        """A verification step's last stage: float32 logits at every row and each row's argmax in
        st.tokens. Greedy: the LM head's own pick, as a greedy decode step makes it (its logits
        may be exact only where rescored); sampled: exact logits (acceptance turns them into the
        target's distributions)."""
        self.dec.head(st, greedy=not variant.sampled)
        if st.tokens is None:
            st.tokens = sampling.greedy(st.logits)

    def _attention_args(self, i: int, st: StepState, seq_lens: torch.Tensor, slots32: torch.Tensor,
                        attn_out: torch.Tensor, rope: bool = False) -> tuple:
        """Layer i's attention arguments after the piece that left `st`: those of
        `decode_with_rope` with `rope` (RoPE inside attention), else those of `__call__` (no
        length hint)."""
        dec, cache = self.dec, self.cache
        if rope:
            return (st.qkv, dec.cos, dec.sin, cache.k[i], cache.v[i], slots32, seq_lens, attn_out, dec.scale)
        return (st.q, cache.k[i], cache.v[i], slots32, seq_lens, attn_out, dec.scale)

    def run_eager(self, b: int, variant: int, block: int = 1) -> StepOutputs:
        st = StepState()
        run_pieces(st, *self.pieces(b, variant, block=block))
        return StepOutputs(st.tokens, st.logits)


def bind_program(decoder: Decoder, cache: KVCache, bufs: StepBuffers, attention: DecodeAttention,
                 attention_is_triton: bool) -> StepProgram:
    """The step program of `decoder` over `cache` and `bufs`, its attention bound to the decoder
    (how the call runs, and whether its first kernel may launch dependently)."""
    entry_pdl = decoder.bind_attention(rope_in_attention=attention.rope_in_attention,
                                       attention_is_triton=attention_is_triton)
    attention.pdl_entry = entry_pdl and attention.pdl
    return StepProgram(decoder, cache, bufs, attention)


def run_pieces(st: StepState, pieces: list[Piece], attends: list[Callable[[StepState], None]]) -> None:
    """The decode step's order: pieces[0], attends[0], pieces[1], ..., attends[L-1], pieces[L]."""
    for j, piece in enumerate(pieces):
        piece(st)
        if j < len(attends):
            attends[j](st)
