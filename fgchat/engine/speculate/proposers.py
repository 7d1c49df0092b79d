"""Draft proposers without a second model: prompt lookup (`ngram`) and the `oracle` (a recorded
greedy continuation of the same prompt, for benchmarks and tests)."""

from __future__ import annotations

NGRAM_MAX, NGRAM_MIN = 3, 1


def ngram_propose(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the last n tokens of `tokens` (prompt
    and text so far), trying n from n_max down to n_min: the latest occurrence with k followers,
    else the one with the most (in a repeating run the latest has only one); [] when nothing
    matches."""
    total = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        tail = tokens[total - n:]
        best: list[int] = []
        for s in range(total - n - 1, -1, -1):  # starts whose n tokens end before the tail's last
            if tokens[s:s + n] == tail:
                follow = tokens[s + n:s + n + k]
                if len(follow) > len(best):
                    best = follow
                if len(best) == k:
                    break
        if best:
            return best
    return []


# once the text leaves the recorded run: the longest tail of the text, up to this many tokens,
# found in the run ending within ANCHOR_WINDOW positions of the text's length
ANCHOR_TAIL, ANCHOR_WINDOW = 3, 32


class Oracle:
    """Recorded continuations by prompt: the drafts are what an earlier greedy run of the same
    prompt emitted after the text so far. While the text follows the run, its next tokens; once
    the text left it (a near-tied argmax that the verification step and the run's steps round
    differently), the run re-anchored: after the longest tail of the text found near the same
    position, else position for position. Proposes nothing for an unknown prompt."""

    def __init__(self) -> None:
        self._runs: dict[tuple[int, ...], list[int]] = {}

    def record(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self._runs[tuple(prompt_ids)] = list(output_ids)

    def __len__(self) -> int:
        return len(self._runs)

    def propose(self, prompt_ids: list[int], output_ids: list[int], k: int) -> list[int]:
        run = self._runs.get(tuple(prompt_ids))
        n = len(output_ids)
        if run is None or k <= 0:
            return []
        if run[:n] == output_ids:
            return run[n:n + k]
        at = anchor(run, output_ids)
        return run[at:at + k]


def anchor(run: list[int], text: list[int]) -> int:
    """Where `run` goes on after `text` once they differ: the end of the longest tail of `text`
    (ANCHOR_TAIL tokens down to 1) that `run` holds ending within ANCHOR_WINDOW of len(text), the
    nearest such end; else len(text)."""
    n = len(text)
    for t in range(min(ANCHOR_TAIL, n), 0, -1):
        tail = text[n - t:]
        ends = [e for e in range(max(t, n - ANCHOR_WINDOW), min(len(run), n + ANCHOR_WINDOW) + 1)
                if run[e - t:e] == tail]
        if ends:
            return min(ends, key=lambda e: abs(e - n))
    return n
