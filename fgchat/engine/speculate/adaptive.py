"""Adaptive draft length, per request: k shrinks when drafts are rejected, grows back when they
are accepted, and speculation pauses when it keeps finding nothing to accept (a step that
proposes nothing, or whose drafts all fail), probing again after a pause that doubles while the
probes keep failing. Paused, a request decodes as plain decoding does (pipelined on CUDA), so a
prompt with nothing to look up costs little more than the probes."""

from __future__ import annotations

from dataclasses import dataclass

# a step accepting at most this share of its drafts shrinks k; all of them grows it
SHRINK_BELOW = 0.5
MISSES_TO_PAUSE = 3  # steps in a row that accept nothing before a pause
FIRST_PAUSE, LONGEST_PAUSE = 8, 128  # plain steps of a pause


@dataclass
class AdaptiveK:
    k_max: int
    k: int = 0
    misses: int = 0  # steps in a row that accepted nothing
    pause: int = FIRST_PAUSE  # the next pause's length
    paused_for: int = 0  # plain steps left in the current pause
    # totals over the request (RequestSummary.spec)
    steps: int = 0  # speculative steps
    proposed: int = 0
    accepted: int = 0
    cost_paused: int = 0  # plain steps while speculation cost more than plain decoding (speculate.payoff)

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    @property
    def paused(self) -> bool:
        return self.paused_for > 0

    def want(self) -> int:
        """Drafts to ask for this step (0 while paused)."""
        return 0 if self.paused else min(self.k, self.k_max)

    def tick(self) -> None:
        """A plain step ran while paused."""
        self.paused_for = max(self.paused_for - 1, 0)

    def update(self, proposed: int, accepted: int) -> None:
        """After a step that asked for drafts: `proposed` came, `accepted` of them held."""
        if proposed:
            self.steps += 1
            self.proposed += proposed
            self.accepted += accepted
        if proposed and accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif proposed and accepted <= SHRINK_BELOW * proposed:
            self.k = max(accepted + 1, self.k // 2, 1)
        if accepted:
            self.misses, self.pause = 0, FIRST_PAUSE
            return
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.paused_for, self.misses = self.pause, MISSES_TO_PAUSE - 1  # one more miss: paused again
            self.pause = min(self.pause * 2, LONGEST_PAUSE)
