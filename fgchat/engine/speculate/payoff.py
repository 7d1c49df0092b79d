"""Whether speculation pays, engine-wide, per (mode, batch size): a speculative step must emit
its tokens faster than plain decoding does, or speculation pauses at that shape.

Both sides are measured from steps that ran, in the same unit: a step's cost in ms is the larger
of its host wall time and its GPU time (where the device measures one). Plain decoding's cost per
token is its step cost; speculation's is its step cost over the mean tokens a sequence emitted in
that step (accepted drafts + the target's token). Each is a running mean over the last ~EMA_STEPS
steps of that shape.

A new shape speculates first (a request that gains from speculation gains from its first step;
its cost is measured meanwhile); after SPEC_SAMPLES speculative steps with no plain estimate, the
shape runs PLAIN_WARMUP plain steps (the first not counted: its timing holds one-off start-up
work), since a request whose drafts keep being accepted would otherwise never run one. The
estimates live as long as the engine, so that costs a few steps per shape once. With both sides
measured a verdict follows every step that changes one: speculation's token costing more than
plain's by MARGIN pauses it at that shape for a number of steps that doubles while the probes
after each pause keep losing; a probe starts a fresh speculative estimate (the one that lost does
not outvote it). A win keeps speculation on and resets the pause to its first length. Per-request
acceptance (speculate.adaptive) decides the draft length separately."""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_STEPS = 16  # the running means weigh about this many recent steps
MARGIN = 0.05  # speculation's cost per token may exceed plain's by this share before it pauses
PLAIN_WARMUP = 3  # plain steps a shape runs to measure plain decoding (the first not counted)
SPEC_SAMPLES = 2  # speculative steps measured (since the last pause) before a verdict
FIRST_PAUSE, LONGEST_PAUSE = 16, 256  # steps of a pause

SPECULATE, MEASURE_PLAIN, PAUSED = "speculate", "measure plain", "paused"


@dataclass
class RunningMean:
    """The mean of the samples while there are fewer than EMA_STEPS, then an exponential moving
    average weighing about the last EMA_STEPS."""

    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += (x - self.value) * max(1.0 / self.n, 2.0 / (EMA_STEPS + 1))


@dataclass
class ShapeCost:
    """One (mode, batch size): plain ms per step, speculation's ms per emitted token, the pause."""

    plain: RunningMean = field(default_factory=RunningMean)
    spec: RunningMean = field(default_factory=RunningMean)
    plain_seen: int = 0  # plain steps timed, the warm-up one included
    paused_for: int = 0  # steps left in the current pause
    pause: int = FIRST_PAUSE  # the next pause's length
    pauses: int = 0  # pauses so far (diagnostics, tests)

    def losing(self) -> bool:
        return self.spec.value > self.plain.value * (1.0 + MARGIN)


class SpecPayoff:
    """The engine's cost estimates and pauses, keyed by (mode, batch size)."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[str, int], ShapeCost] = {}

    def _shape(self, mode: str, b: int) -> ShapeCost:
        return self.shapes.setdefault((str(mode), b), ShapeCost())

    def verdict(self, mode: str, b: int) -> str:
        """SPECULATE, MEASURE_PLAIN (speculation measured, plain not yet) or PAUSED for the next
        step at this shape; a PAUSED answer counts that step as one of the pause."""
        s = self._shape(mode, b)
        if s.paused_for:
            s.paused_for -= 1
            return PAUSED
        if s.plain_seen < PLAIN_WARMUP and s.spec.n >= SPEC_SAMPLES:
            return MEASURE_PLAIN
        return SPECULATE

    def plain_step(self, mode: str, b: int, ms: float) -> None:
        """A plain decode step of batch size b ran in `ms`."""
        s = self._shape(mode, b)
        s.plain_seen += 1
        if s.plain_seen > 1:
            s.plain.add(ms)
            if s.plain_seen == PLAIN_WARMUP:
                self._judge(s)  # speculation was measured first

    def spec_step(self, mode: str, b: int, ms: float, tokens_per_seq: float) -> None:
        """A speculative step of batch size b ran in `ms` and emitted `tokens_per_seq` tokens per
        sequence on average."""
        s = self._shape(mode, b)
        if tokens_per_seq > 0:
            s.spec.add(ms / tokens_per_seq)
            self._judge(s)

    @staticmethod
    def _judge(s: ShapeCost) -> None:
        """With both sides measured: a loss pauses speculation at the shape, a win keeps it on."""
        if s.plain_seen < PLAIN_WARMUP or s.spec.n < SPEC_SAMPLES:
            return
        if not s.losing():
            s.pause = FIRST_PAUSE
            return
        s.paused_for, s.pauses = s.pause, s.pauses + 1
        s.pause = min(s.pause * 2, LONGEST_PAUSE)
        s.spec = RunningMean()  # the probe after the pause is judged on its own steps

    def reset_speculation(self) -> None:
        """Speculation's side forgotten (another method or draft length); plain's kept."""
        for s in self.shapes.values():
            s.spec, s.paused_for, s.pause = RunningMean(), 0, FIRST_PAUSE
