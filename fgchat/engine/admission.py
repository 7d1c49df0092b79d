"""One admission round: requests with the same prompt share one prefill.

K replies to one conversation (the TUI's F4, `generate --n K`, an endpoint's `n`) arrive as K
requests with the same prompt ids. The round prefills each distinct prompt once, into the slot
of the first request that has it, and copies the prompt's K/V rows to the other requests' slots;
every request then samples its first token from the shared last logits with its own parameters.

Invariant: a follower's cache rows [0, T) hold the same bits its own prefill would have written
(prefill writes only the slot it is given, and the slot changes no value), so decode cannot tell
a shared prefill from its own.
"""

from __future__ import annotations

from fgchat.engine.requests import Sequence


def share_prompts(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Groups of `seqs` with identical prompt ids, in admission order; each group's first
    sequence is the one that prefills."""
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(tuple(seq.prompt_ids), []).append(seq)
    return list(groups.values())
