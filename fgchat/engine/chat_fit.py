"""A chat that has outgrown the context: its oldest turns are left out of the prompt.

Invariants:
- The leading system message(s) and the last message are always kept; turns go oldest first,
  a user message together with the assistant reply that follows it (chat templates such as
  Mistral's need user and assistant to alternate from a user message on).
- The prompt leaves `reserve` positions free for the reply. What is left out is a whole number of
  `quantum`s of tokens (rounded up to whole turns): as the chat grows by later turns, the same
  oldest turns stay out until the overflow passes the next quantum, so consecutive prompts keep
  one prefix and the engine reuses its cached rows (engine.prefix_reuse) instead of prefilling
  the whole chat at every turn.
- When even the system message(s) and the last message do not fit, the shortest prompt found is
  returned and the engine refuses it with its usual one-line error.
"""

from __future__ import annotations

from collections.abc import Callable

Messages = list[dict[str, str]]


def fit_chat(encode: Callable[[Messages], list[int]], messages: Messages, max_context: int,
             reserve: int, quantum: int = 1) -> tuple[list[int], int]:
    """(prompt ids, messages left out) for `messages` in a context of `max_context` positions
    with `reserve` of them kept for the reply."""
    limit = max_context - max(reserve, 1)
    ids = encode(messages)
    if len(ids) <= limit:
        return ids, 0
    quantum = max(quantum, 1)
    target = -(-(len(ids) - limit) // quantum) * quantum  # tokens to leave out, whole quanta
    full = len(ids)
    lead = 0
    while lead < len(messages) - 1 and messages[lead].get("role") == "system":
        lead += 1
    body, dropped = messages[lead:], 0
    while (full - len(ids) < target or len(ids) > limit) and len(body) - dropped > 1:
        pair = (body[dropped].get("role") == "user" and len(body) - dropped > 2
                and body[dropped + 1].get("role") == "assistant")
        dropped += 2 if pair else 1
        ids = encode(messages[:lead] + body[dropped:])
    return ids, dropped
