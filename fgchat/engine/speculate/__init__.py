"""Speculative decoding: proposers (prompt lookup, a draft model, an oracle), the verification
step over k + 1 positions per sequence, the acceptance rule and the adaptive draft length.

Invariant: speculation never changes what a request emits beyond what its sampling allows —
greedy output is the target's own argmax at every position, sampled output follows the target's
distribution (speculative rejection sampling)."""

from __future__ import annotations

from fgchat.protocol.errors import FgchatError

METHODS: tuple[str, ...] = ("off", "ngram", "draft", "oracle")
MIN_DRAFT_LEN, MAX_DRAFT_LEN = 1, 8


def check_method(method: str) -> str:
    """`method` if it names a speculation method, else one clear FgchatError line."""
    if method not in METHODS:
        raise FgchatError(f"unknown speculation method '{method}' (choose {', '.join(METHODS)})")
    return method


def check_draft_len(k: int) -> int:
    """`k` if it is a draft length the engine runs (1..8), else one clear FgchatError line."""
    if isinstance(k, bool) or not isinstance(k, int) or not (MIN_DRAFT_LEN <= k <= MAX_DRAFT_LEN):
        raise FgchatError(f"draft length must be between {MIN_DRAFT_LEN} and {MAX_DRAFT_LEN}, got {k}")
    return k
