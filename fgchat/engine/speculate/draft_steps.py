"""The draft model's decode steps in the target's mode: its own step buffers, StepProgram and
ModeSet (graphs captured on first use, into the target's graph pool on its capture stream), so
that in `full` each of its steps replays a graph per (batch size, rows per sequence), in
`piecewise` its pieces, and in `eager` the same pieces run plainly.

A proposal is one block step (each sequence's catch-up rows: the tokens accepted since its last
proposal, 1 or 2 when it drafted last step, the last of them its newest token) and then single-
token steps, each fed the previous step's picks. Greedy batches chain the steps on the device
(each step's ids and positions advanced there from the previous step's picks) and read the
drafted ids once, at the end; a batch with a sampled sequence reads each step's logits on the
host (the draft distribution q, drawn on the host as accept.py's rejection sampling needs).

Invariants:
- lanes [0, B) of the buffers hold the batch's sequences in order, every step of a proposal;
- every step writes the K/V of its rows before any row reads them (step.StepProgram.pieces), and
  a padding row (a sequence with fewer catch-up rows than the block) writes a position past its
  sequence's last real row, which the next step writes again before reading it;
- positions are clamped to the cache's last row: rows a sequence cannot use (past its room) land
  there, past every row it reads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fgchat.engine.kernels.attention import get_backend
from fgchat.engine.kv_cache import NUM_SLOTS, KVCache
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.modes import ModeSet
from fgchat.engine.speculate import MAX_DRAFT_LEN
from fgchat.engine.speculate.verify import block_rows
from fgchat.engine.step import ROW_IDS, ROW_POS, ROW_SLOT, StepBuffers, StepOutputs, Variant, bind_program
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import CaptureReport, Mode

# the most rows per sequence a proposal's first step takes; a longer catch-up (after plain steps,
# or the prompt itself) writes its head through the prefill path first (verify.verify_logits)
CATCH_UP_ROWS = 2

Block = tuple[list[int], int, int]  # (token ids, position of the first, slot)


class DraftSteps:
    """The draft decoder's step program and modes; `greedy` and `step_logits` run a proposal."""

    def __init__(self, dec: Decoder, cache: KVCache, attention_name: str, tuning: object | None,
                 note: Callable[[str], None], share: ModeSet | None = None) -> None:
        cfg = dec.cfg
        self.dec = dec
        self.max_context = cache.max_context
        self.bufs = StepBuffers(dec.device, cfg.num_heads, cfg.head_dim, dec.dtype)
        try:
            attention = get_backend(attention_name, dec.device, tuning, cfg.head_dim)  # type: ignore[arg-type]
        except FgchatError as exc:  # the target's backend lacks the draft's head dim
            note(f"draft model: {exc}; its attention runs on torch")
            attention = get_backend("torch", dec.device, tuning)  # type: ignore[arg-type]
        self.program = bind_program(dec, cache, self.bufs, attention, attention.name == "triton")
        self.modes = ModeSet(self.program, note, share, decode_only=True)
        cuda = dec.device.type == "cuda"
        # each sequence's last real row of the block step (pinned: copied behind the staging)
        self._last_host = torch.zeros(NUM_SLOTS, dtype=torch.int64, pin_memory=cuda)
        self._last = torch.zeros(NUM_SLOTS, dtype=torch.int64, device=dec.device)
        self._picked = torch.zeros((NUM_SLOTS, MAX_DRAFT_LEN), dtype=torch.int64, device=dec.device)
        self.ran: list[Mode] = []  # the mode each step of the latest proposal ran in

    # ---- one step ----
    def _mode(self, mode: Mode) -> Mode:
        """`mode` where the draft's modes can run it, else eager (a mode its captures disabled)."""
        return mode if mode in self.modes.modes and not self.modes.unavailable.get(mode) else Mode.EAGER

    def _run(self, mode: Mode, b: int, variant: Variant, block: int = 1) -> StepOutputs:
        """One step in `mode`, its graph captured first where new (over the staged inputs: the
        capture's runs write the same K/V rows); a capture that fails disables that mode for the
        draft, with a note, and the step runs eagerly."""
        mode = self._mode(mode)
        out, ran = self.modes.run(mode, b, variant, block)
        self.ran.append(ran)
        return out

    def _stage_block(self, blocks: list[Block]) -> tuple[int, list[int]]:
        """Stage the block step's rows; (rows per sequence, each sequence's last real row)."""
        ids, pos, slots, block = block_rows([b[0][0] for b in blocks], [b[0][1:] for b in blocks],
                                            [b[1] + 1 for b in blocks], [b[2] for b in blocks], self.max_context)
        n = len(ids)
        self.bufs.stage(ids, pos, slots, [0.0] * n, [1.0] * n, [0] * n, [0] * n)
        self.program.max_len_hint = max(pos) + 1
        return block, [i * block + len(b[0]) - 1 for i, b in enumerate(blocks)]

    def _hint(self, blocks: list[Block], j: int) -> None:
        """The host's bound of step j's lengths (step 0 is the block step)."""
        self.program.max_len_hint = min(max(f + len(ids) for ids, f, _ in blocks) + j, self.max_context)

    # ---- a proposal ----
    def greedy(self, blocks: list[Block], steps: int, mode: Mode) -> list[list[int]]:
        """`steps` greedy drafts for each sequence whose catch-up rows `blocks` holds (at most
        CATCH_UP_ROWS each), chained on the device; one read of the drafts at the end."""
        self.ran = []
        b = len(blocks)
        block, last = self._stage_block(blocks)
        out = self._run(mode, b, Variant.GREEDY, block)
        picked = self._picked[:b]
        di = self.bufs.dev_i
        if block == 1:
            picked[:, 0].copy_(out.tokens[:b])
        else:
            self._last_host[:b] = torch.tensor(last, dtype=torch.int64)
            sel = self._last[:b]
            sel.copy_(self._last_host[:b], non_blocking=True)
            picked[:, 0].copy_(out.tokens.index_select(0, sel))
            if steps > 1:  # lanes [0, b): each sequence's last row, advanced below
                di[ROW_POS, :b].copy_(di[ROW_POS].index_select(0, sel))
                di[ROW_SLOT, :b].copy_(di[ROW_SLOT].index_select(0, sel))
        for j in range(1, steps):
            di[ROW_IDS, :b].copy_(picked[:, j - 1])
            di[ROW_POS, :b].add_(1).clamp_(max=self.max_context - 1)
            self._hint(blocks, j)
            out = self._run(mode, b, Variant.GREEDY)
            picked[:, j].copy_(out.tokens[:b])
        return picked[:, :steps].tolist()

    def step_logits(self, blocks: list[Block], steps: int, mode: Mode,
                    pick: Callable[[torch.Tensor, list[int]], list[int]]) -> None:
        """`steps` steps whose picks the host makes: pick(logits [B, V] of this step's rows, the
        positions they predict) -> the B tokens the next step feeds. The sampled variant's logits:
        exact, or where the fused head picks from its int8 copy, within that copy's bound past
        the rescored rows; either way q is the distribution the host draws the draft from, which
        is all rejection sampling needs to keep the target's distribution."""
        self.ran = []
        b = len(blocks)
        variant = Variant.SAMPLED  # temperatures staged 0: the step's own picks are unused
        block, last = self._stage_block(blocks)
        out = self._run(mode, b, variant, block)
        nxt = [f + len(ids) for ids, f, _ in blocks]
        toks = pick(out.logits[last], nxt)
        slots = [s for _, _, s in blocks]
        for j in range(1, steps):
            pos = [min(p + j - 1, self.max_context - 1) for p in nxt]
            self.bufs.stage(toks, pos, slots, [0.0] * b, [1.0] * b, [0] * b, [0] * b)
            self._hint(blocks, j)
            out = self._run(mode, b, variant)
            toks = pick(out.logits[:b], [p + j for p in nxt])

    # ---- what the engine reports ----
    def reports(self) -> list[CaptureReport]:
        """The draft's captures, each kind named "draft <kind>" ("draft decode", "draft verify":
        a block step's graph)."""
        return [CaptureReport(r.mode, r.batch_size, r.seconds, r.pool_mib, kind=f"draft {r.kind}")
                for r in self.modes.reports]
