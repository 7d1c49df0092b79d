"""What each KV-cache slot still holds after its sequence ended, so that the next prompt that starts
with the same tokens (the next turn of a chat: the whole conversation again, plus a new message)
prefills only what follows them.

A slot's history is the token ids whose K/V rows [0, len) are in the slot: the prompt and every
output token that was fed back (all but the last), recorded when a sequence ends by a stop token,
its length or a cancel (a stopped reply is kept in the chat, so the next turn starts with it). Admission then gives a request the free slot whose history shares the longest
prefix with its prompt (at least MIN_REUSE tokens), and the prefill starts at that position; a
slot whose history the prompt shares only in part (another chat with the same system prompt) keeps
it, and the shared rows are copied to the request's own slot instead.

Invariants:
- A history is recorded only for a sequence that ended by "stop", "length" or "cancelled" (its
  recorded rows were all written by steps already read); a slot whose rows may have been written
  by anything else (a failed sequence, a slot handed to a new request) has none, and work that
  writes slots outside a request's rows (the start-up check, captures and self-checks while idle,
  a rebuild of the decode path) clears every history. A capture on first use rewrites only the
  rows of the step it captures, with the same values.
- A match leaves at least one prompt token to prefill: the first output token needs its logits.
- The rows reused are the ones the earlier sequence computed (its prefill, then one decode step
  per token), so the new request's numbers can differ from a fresh prefill's in the last bits, as
  two prefills of different lengths can; both are checked against float32 references.
"""

from __future__ import annotations

MIN_REUSE = 32  # shorter shared prefixes are prefilled again (the suffix path costs a little more)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotHistory:
    """Per cache slot, the token ids whose K/V rows it holds from position 0 (empty: none)."""

    def __init__(self, slots: int) -> None:
        self.ids: list[list[int]] = [[] for _ in range(slots)]

    def record(self, slot: int, ids: list[int]) -> None:
        self.ids[slot] = list(ids)

    def forget(self, slot: int) -> None:
        self.ids[slot] = []

    def clear(self) -> None:
        for slot in range(len(self.ids)):
            self.forget(slot)

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """Rows of `slot` a prefill of `prompt` can keep: 0, or MIN_REUSE up to len(prompt) - 1."""
        m = min(common_prefix(self.ids[slot], prompt), len(prompt) - 1)
        return m if m >= MIN_REUSE else 0

    def choose(self, prompt: list[int], free: list[int], reuse: bool = True) -> tuple[int, int, int | None]:
        """(slot, rows to keep, donor) for a request with `prompt`, among the `free` slots.

        The free slot sharing the longest reusable prefix is taken as it is when the prompt
        continues (nearly) all of its history: the next turn of its chat. When it shares only a
        part (another chat with the same system prompt), its history is kept for its own chat:
        the request gets a slot without a history and the shared rows are copied there from the
        donor slot (the caller copies). With no reusable prefix, or reuse False: the first free
        slot without a history, else the first free slot."""
        best, kept = -1, 0
        for slot in free if reuse else []:
            m = self.reusable(slot, prompt)
            if m > kept:
                best, kept = slot, m
        empty = [s for s in free if not self.ids[s]]
        if best >= 0:
            rest = len(self.ids[best]) - kept  # history rows this request would overwrite
            if rest <= max(4, len(self.ids[best]) // 8) or not empty:
                return best, kept, None
            return empty[0], kept, best
        return (empty[0] if empty else free[0]), 0, None
