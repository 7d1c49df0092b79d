"""The `draft` proposer: a second, smaller decoder with the target's tokenizer and its own KV
cache, proposing k tokens by decoding ahead in the target's mode (speculate.draft_steps: its own
step program and graphs; mega's drafts run in full, as its verification does).

Invariant: `valid[slot]` rows of the draft's cache hold the K/V of the slot's sequence as it
stands (the prompt and accepted tokens); rows written for drafts the target rejected lie past it
and are written again before anything attends to them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fgchat.engine.kv_cache import NUM_SLOTS, KVCache
from fgchat.engine.loader import LoadedModel, load_model, load_random
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.modes import ModeSet
from fgchat.engine.requests import Sequence
from fgchat.engine.speculate.accept import STREAM_DRAFT, gumbel_pick, row_uniforms, target_probs
from fgchat.engine.speculate.draft_steps import CATCH_UP_ROWS, DraftSteps
from fgchat.engine.speculate.verify import verify_logits
from fgchat.presets import preset_names
from fgchat.protocol.errors import ModelLoadError
from fgchat.protocol.events import Mode

PRESET_PREFIX = "preset:"


def load_draft(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """The draft model `name` names: "preset:NAME" (or a bare preset name that is not a path) for
    random weights of a preset's shape, else a model as --model takes it."""
    preset = name.removeprefix(PRESET_PREFIX)
    if name.startswith(PRESET_PREFIX) or preset in preset_names():
        return load_random(preset, device, dtype, seed + 1)
    return load_model(name, device, dtype)


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """One ModelLoadError line unless the draft shares the target's vocabulary size and special
    ids (its tokens are the target's tokens)."""
    tc, dc = target.cfg, draft.cfg
    problems = []
    if tc.vocab_size != dc.vocab_size:
        problems.append(f"vocabulary {dc.vocab_size} tokens, the target's {tc.vocab_size}")
    if set(tc.eos_ids) != set(dc.eos_ids):
        problems.append(f"end ids {sorted(dc.eos_ids)}, the target's {sorted(tc.eos_ids)}")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if getattr(tt, "bos_id", None) != getattr(dt, "bos_id", None):
            problems.append(f"BOS id {getattr(dt, 'bos_id', None)}, the target's {getattr(tt, 'bos_id', None)}")
        if set(getattr(tt, "eos_ids", ())) != set(getattr(dt, "eos_ids", ())):
            problems.append("another tokenizer's end ids")
    if problems:
        raise ModelLoadError(f"draft model {draft.name} does not share the target's tokenizer: {'; '.join(problems)}")


class DraftModel:
    """Proposes drafts for a batch by running its own decoder ahead of the target."""

    def __init__(self, loaded: LoadedModel, max_context: int, fused: bool, tuning: object | None = None,
                 attention: str = "auto", note: Callable[[str], None] | None = None,
                 share: ModeSet | None = None) -> None:
        """`attention`: the target's attention backend (by name); `note`: where the draft's mode
        notes go (a capture that failed); `share`: the target's modes, whose graph pool and
        capture streams the draft's graphs use."""
        self.model = loaded
        self.name = loaded.name
        self.dec = Decoder(loaded.cfg, loaded.weights, max_context, fused, tuning)  # type: ignore[arg-type]
        self.cache = KVCache(loaded.cfg, max_context, self.dec.device, self.dec.dtype)
        self.steps = DraftSteps(self.dec, self.cache, attention, tuning, note or (lambda _: None), share)
        self.valid = [0] * NUM_SLOTS
        self._owner: list[Sequence | None] = [None] * NUM_SLOTS

    def propose(self, seqs: list[Sequence], ks: list[int], mode: Mode = Mode.EAGER
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to ks[i] drafts for each sequence, decoded in `mode`, and for a sampled sequence the
        draft's distributions q [k_i, V] they were drawn from (None for greedy: a point mass)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        if not live:
            return drafts, [None] * len(seqs)
        heads, blocks = [], []
        for i in live:
            seq = seqs[i]
            if self._owner[seq.slot] is not seq:
                self._owner[seq.slot], self.valid[seq.slot] = seq, 0
            tokens = seq.prompt_ids + seq.output_ids
            first = min(self.valid[seq.slot], len(tokens) - 1)
            cut = max(first, len(tokens) - CATCH_UP_ROWS)
            if cut > first:
                heads.append((tokens[first:cut], first, seq.slot))
            blocks.append((tokens[cut:], cut, seq.slot))
        if heads:
            verify_logits(self.dec, heads, self.cache.k, self.cache.v, logits=False)
        steps = max(ks[i] for i in live)  # every lane steps as often; each keeps its own k
        lanes = [seqs[i] for i in live]
        if all(s.params.temperature <= 0 for s in lanes):
            picked = self.steps.greedy(blocks, steps, mode)
        else:
            picked = [[] for _ in live]

            def pick(logits: torch.Tensor, positions: list[int]) -> list[int]:
                out = []
                for n, (tok, q) in enumerate(self._pick(lanes, logits, positions)):
                    if len(picked[n]) < ks[live[n]]:
                        picked[n].append(tok)
                        if q is not None:
                            qs[live[n]].append(q)
                    out.append(tok)
                return out

            self.steps.step_logits(blocks, steps, mode, pick)
        for n, i in enumerate(live):
            drafts[i] = picked[n][:ks[i]]
            self.valid[seqs[i].slot] = seqs[i].length - 1 + ks[i]  # the last token and drafts 1..k-1
        return drafts, [torch.stack(q) if q else None for q in qs]

    @property
    def modes_ran(self) -> list[Mode]:
        """The mode each step of the latest proposal ran in."""
        return self.steps.ran

    def _pick(self, seqs: list[Sequence], logits: torch.Tensor, positions: list[int]
              ) -> list[tuple[int, torch.Tensor | None]]:
        """Each sequence's draft at `positions` from the draft's logits [n, V]: the argmax for a
        greedy request, else a draw from its filtered distribution q (returned with it)."""
        out: list[tuple[int, torch.Tensor | None]] = []
        for seq, row, pos in zip(seqs, logits, positions):
            p = seq.params
            if p.temperature <= 0:
                out.append((int(torch.argmax(row)), None))
                continue
            dev = row.device
            q = target_probs(row[None], torch.tensor([p.temperature], device=dev),
                             torch.tensor([p.top_p], device=dev), torch.tensor([p.top_k], device=dev))
            u = row_uniforms(p.seed, [pos], STREAM_DRAFT, q.shape[1], dev)
            out.append((int(gumbel_pick(q, u)[0]), q[0]))
        return out

    def settle(self, seq: Sequence, length_before: int, drafted: int, accepted: int) -> None:
        """After verification: the rows that hold accepted tokens stay valid. The draft wrote rows
        [length_before, length_before + drafted - 1) for its drafts 1..drafted-1."""
        if self._owner[seq.slot] is seq:
            self.valid[seq.slot] = min(self.valid[seq.slot], length_before + min(accepted, max(drafted - 1, 0)))

    def forget(self, seq: Sequence) -> None:
        if 0 <= seq.slot < NUM_SLOTS and self._owner[seq.slot] is seq:
            self._owner[seq.slot], self.valid[seq.slot] = None, 0
