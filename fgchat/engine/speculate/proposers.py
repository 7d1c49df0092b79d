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


class Oracle:
    """Recorded continuations by prompt: the drafts are what an earlier run of the same prompt
    emitted after the text so far. Proposes nothing for an unknown prompt or once the text leaves
    the recorded one."""

    def __init__(self) -> None:
        self._runs: dict[tuple[int, ...], list[int]] = {}

    def record(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self._runs[tuple(prompt_ids)] = list(output_ids)

    def __len__(self) -> int:
        return len(self._runs)

    def propose(self, prompt_ids: list[int], output_ids: list[int], k: int) -> list[int]:
        run = self._runs.get(tuple(prompt_ids))
        n = len(output_ids)
        if run is None or k <= 0 or run[:n] != output_ids:
            return []
        return run[n:n + k]
