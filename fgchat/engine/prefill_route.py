"""Admission and prefill routing: the waiting requests' slots (with prefix reuse), their prompts
prefilled (shared prompts once, several prompts in one pass where it can, after cached rows
where a slot holds the prompt's start) and their first tokens picked. A mixin of `Engine`
(engine.core), which holds the state it uses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fgchat.engine.admission import share_prompts
from fgchat.engine.kernels import sampling
from fgchat.engine.requests import Sequence
from fgchat.protocol.errors import error_line
from fgchat.protocol.events import EngineError, EngineEvent, Mode

if TYPE_CHECKING:
    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.model.config import ModelConfig
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.modes import ModeSet
    from fgchat.engine.prefix_reuse import SlotHistory
    from fgchat.engine.scheduler import Scheduler
    from fgchat.engine.step import StepProgram
    from fgchat.protocol.tuning import Tuning


def _only_argmax(group: list[Sequence]) -> bool:
    """A prompt's last logits serve only an argmax: every request sharing it is greedy and
    unpenalized (then the prefill may take them from the LM head's int8 pick)."""
    return all(s.params.temperature <= 0 and not s.params.penalized for s in group)


class PrefillRoute:
    """Admits waiting requests and starts them with their first tokens."""

    device: torch.device
    tuning: Tuning
    cfg: ModelConfig
    cache: KVCache
    decoder: Decoder
    program: StepProgram
    modes: ModeSet
    mode: Mode
    scheduler: Scheduler
    history: SlotHistory
    _pending: list[EngineEvent]

    def _admit(self) -> bool:
        """Prefill the newly admitted requests, each distinct prompt once (engine.admission),
        and start them with their first tokens; whether any was emitted."""
        pending: list[tuple[Sequence, torch.Tensor]] = []
        choose = self._choose_slot if self.reuses_prefixes else None
        for group, logits in self._prefill_groups(share_prompts(self.scheduler.admit(choose))):
            if logits is None:
                continue
            lead = group[0]
            self.cache.copy_prefix(lead.slot, [s.slot for s in group[1:]], len(lead.prompt_ids))
            for seq in group[1:]:  # their rows are the lead's: so is what its prefill skipped
                seq.cached_tokens = lead.cached_tokens
            pending += [(seq, logits) for seq in group]
        firsts = self._first_tokens(pending)
        # First tokens of one admission round are read with one sync and emitted together, so
        # a request's decode latencies never include the prefills of requests admitted with it.
        if firsts:
            ids = torch.cat([tok for _, tok in firsts]).tolist()
            for (seq, _), token in zip(firsts, ids):
                self.scheduler.start(seq)
                self._emit(seq, token, Mode.EAGER, 1, None, None)
        return bool(firsts)

    def _prefill_groups(
        self, groups: list[list[Sequence]]
    ) -> Iterator[tuple[list[Sequence], torch.Tensor | None]]:
        """Each group with the last logits [V] of its prompt (a tensor of its own), prefilled into
        group[0]'s slot (None when that failed: the group is finished with the error). One pass
        over all the prompts where `_prefill_together` can, else one prefill per group."""
        for group in [g for g in groups if g[0].cached_tokens]:
            yield group, self._prefill_after(group)
        groups = [g for g in groups if not g[0].cached_tokens]
        together = self._prefill_together([g[0] for g in groups]) if len(groups) > 1 else None
        if together is not None:
            yield from zip(groups, together)
            return
        for group in groups:
            yield group, self._prefill(group)

    def _prefill(self, group: list[Sequence]) -> torch.Tensor | None:
        """Prefill group[0]'s prompt into its slot; returns the last logits [V]."""
        lead = group[0]
        ids = torch.tensor(lead.prompt_ids, dtype=torch.int64, device=self.device)
        try:
            return self.modes.prefill_logits(self.mode, ids, lead.slot, _only_argmax(group))
        except torch.OutOfMemoryError:
            return self._fail_group(group, "out of memory during prefill")

    def _fail_group(self, group: list[Sequence], message: str) -> None:
        """Every request of `group` (one whose prefill failed; or all, after a failed step) ends
        with `message` (one line)."""
        for seq in group:
            self._pending.append(EngineError(message, seq.request_id))
            self._finish(seq, "error")

    @property
    def reuses_prefixes(self) -> bool:
        """A prompt that starts with what a free slot still holds is prefilled from there
        (engine.prefix_reuse): on CPU, or where Tuning.prefix_reuse says so. Work that
        writes slots outside a request's own rows (captures while idle, self-checks, the start-up
        check, a rebuild) forgets every history first."""
        reuse = self.tuning.prefix_reuse
        return reuse is True or (reuse is None and self.device.type == "cpu")

    def _choose_slot(self, seq: Sequence, free: list[int]) -> int:
        """The free slot for `seq` (SlotHistory.choose) and how many rows of its prompt are
        there before the prefill (seq.cached_tokens: kept in place, or copied from a donor slot
        whose history stays); the chosen slot's history ends here."""
        slot, seq.cached_tokens, donor = self.history.choose(seq.prompt_ids, free,
                                                             self._suffix_prefill_pays(len(seq.prompt_ids)))
        if donor is not None:
            self.cache.copy_prefix(donor, [slot], seq.cached_tokens)
        self.history.forget(slot)
        return slot

    def _suffix_prefill_pays(self, prompt_len: int) -> bool:
        """A prefill after cached rows runs eagerly; where a prefill graph would run the whole
        prompt (full mode), the graph is the faster one (the eager fused path launches ~10 kernels
        a layer from the host), so there the prompt is prefilled afresh."""
        graphs = self.modes.prefill_graphs
        return not (self.mode == Mode.FULL and graphs is not None and graphs.covers(prompt_len))

    def _prefill_after(self, group: list[Sequence]) -> torch.Tensor | None:
        """Prefill group[0]'s prompt from position seq.cached_tokens (the rows before it are in
        its slot); returns the last logits [V]."""
        from fgchat.engine.model.prefill import prefill_after

        lead = group[0]
        m = lead.cached_tokens
        ids = torch.tensor(lead.prompt_ids[m:], dtype=torch.int64, device=self.device)
        try:
            return prefill_after(self.decoder, ids, m, lead.slot, self.cache.k, self.cache.v, _only_argmax(group))
        except (RuntimeError, MemoryError) as exc:
            return self._fail_group(group, f"prefill failed: {error_line(exc)}")

    def _prefill_together(self, seqs: list[Sequence]) -> list[torch.Tensor] | None:
        """Several prompts in one pass, their last logits [V] each: stacked rows make larger
        matrix products (CPU, unfused: 8 x 64 tokens of SmolLM2 in 0.69 s instead of 1.04 s).
        None when it cannot run (no memory for the stacked rows): the caller then prefills one
        by one."""
        from fgchat.engine.model import prefill as pf

        run = pf.prefill_many_fused if self.decoder.fused else pf.prefill_many
        prompts = [(torch.tensor(s.prompt_ids, dtype=torch.int64, device=self.device), s.slot) for s in seqs]
        try:
            batch = self.modes.prefill_many_logits(self.mode, prompts)
            if batch is not None:
                return batch
            return run(self.decoder, prompts, self.cache.k, self.cache.v)
        except (RuntimeError, MemoryError):  # e.g. no memory for the stacked rows: one by one
            return None

    def _first_tokens(self, pairs: list[tuple[Sequence, torch.Tensor]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Each request's first token [1] from its prompt's last logits [V], in order. Requests
        without penalties are picked together, one pick over their stacked logits, as a decode
        step picks its lanes; a penalized one has its logits penalized first."""
        plain = [i for i, (seq, _) in enumerate(pairs) if not seq.params.penalized]
        toks: dict[int, torch.Tensor] = {}
        if plain:
            picked = self._pick(torch.stack([pairs[i][1] for i in plain]), [pairs[i][0] for i in plain])
            toks = {i: picked[j:j + 1] for j, i in enumerate(plain)}
        return [(seq, toks[i] if i in toks else self._first_token_penalized(seq, logits))
                for i, (seq, logits) in enumerate(pairs)]

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """First tokens [n] of `seqs` from their prompts' last logits [n, V]: all greedy, the
        chunked argmax (not torch.argmax's single block); else the sampler with each row's
        parameters at the position after its prompt."""
        ps = [s.params for s in seqs]
        if all(p.temperature <= 0 for p in ps):
            return sampling.greedy(logits)
        dev = self.device
        return sampling.sample(
            logits.float(), torch.tensor([p.temperature for p in ps], device=dev),
            torch.tensor([p.top_p for p in ps], device=dev), torch.tensor([p.top_k for p in ps], device=dev),
            torch.tensor([p.seed for p in ps], device=dev),
            torch.tensor([len(s.prompt_ids) for s in seqs], device=dev),
            filtered=any(sampling.needs_filter(p.top_p, p.top_k, self.cfg.vocab_size) for p in ps),
        )

    def _first_token_penalized(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """A penalized request's first token [1]: its prompt's ids counted from here (output ids
        as they are sampled), its last logits [V] penalized, then picked."""
        from fgchat.engine.kernels import penalties

        p = seq.params
        dev = self.device
        prog = self.program
        slot = torch.tensor([seq.slot], device=dev)
        penalties.reset_slot(prog.counts, prog.prompt_mask, seq.slot, seq.prompt_ids)
        logits = logits.float().clone()[None]
        penalties.apply_penalties(logits, prog.counts, prog.prompt_mask, slot,
                                  torch.tensor([p.repetition_penalty], device=dev),
                                  torch.tensor([p.presence_penalty], device=dev),
                                  torch.tensor([p.frequency_penalty], device=dev))
        tok = self._pick(logits, [seq])
        penalties.record_tokens(prog.counts, slot, tok)
        return tok
