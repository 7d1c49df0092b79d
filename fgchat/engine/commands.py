"""Commands from a parent (UI, server) to the engine's serving loop: plain dataclasses, so they
pickle through the engine process's queue."""

from __future__ import annotations

from dataclasses import dataclass

from fgchat.protocol.events import SamplingParams


@dataclass(frozen=True)
class SubmitChat:
    request_id: int
    messages: list[dict[str, str]]
    params: SamplingParams


@dataclass(frozen=True)
class SubmitChats:
    """K replies to one conversation, applied in one go: the messages are tokenized once and all
    K requests are submitted before the next engine step, so they are admitted and prefilled in
    the same round and decode together from their first step (batch K). `messages` as a plain
    string is a raw prompt: encoded as text with the model's BOS, no chat template (as
    `fgchat generate --raw`, and /v1/completions)."""

    messages: list[dict[str, str]] | str
    requests: tuple[tuple[int, SamplingParams], ...]  # (request_id, params) per reply
    # a chat longer than the context loses its oldest turns (engine.chat_fit) and a RequestNotice
    # says so, instead of the request failing (the TUI's chats; the server keeps OpenAI's error)
    fit_context: bool = False
    # the chat template's `enable_thinking` (Qwen3: whether the reply opens with its reasoning);
    # None: the template's own default. A template without the variable ignores it
    enable_thinking: bool | None = None


@dataclass(frozen=True)
class Cancel:
    request_id: int


@dataclass(frozen=True)
class SetMode:
    mode: str


@dataclass(frozen=True)
class SetSpeculation:
    method: str  # "off" | "ngram" | "draft" | "oracle"
    draft_len: int | None = None  # None: keep the current k


@dataclass(frozen=True)
class GetInfo:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


Command = SubmitChat | SubmitChats | Cancel | SetMode | SetSpeculation | GetInfo | Shutdown
