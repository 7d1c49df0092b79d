"""EngineHandle: the interface the TUI, the server and the benchmark drive an engine through.

Three kinds implement it: EngineProcess (the engine in a child process), EngineThread (the engine
on a thread of this process; tests, embedding) and EndpointClient (a remote OpenAI-compatible
server). Commands return at once; what they cause comes back as events from `get_events`, in
order. A command a handle cannot carry out raises FgchatError with one line (an endpoint cannot
take a raw prompt) or comes back as an EngineError event."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fgchat.protocol.events import SamplingParams


@runtime_checkable
class EngineHandle(Protocol):
    # a chat longer than the model's context loses its oldest turns instead of failing (the
    # TUI's chats); an endpoint's server keeps its own policy
    fit_context: bool
    # time.monotonic() when start() was called; None before
    started_at: float | None
    # the engine's local process id; None where the engine is not a process of this machine
    pid: int | None

    def start(self) -> None:
        """Start the engine and return at once; its EngineInfo (or a fatal EngineError) follows."""

    def is_alive(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """A fatal error was seen or reported: the engine no longer runs."""

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine (replies in flight end); idempotent."""

    def submit_chat(self, request_id: int, messages: list[dict[str, str]], params: SamplingParams) -> None: ...

    def submit_chats(self, messages: list[dict[str, str]] | str,
                     requests: list[tuple[int, SamplingParams]]) -> None:
        """K replies to the same messages (or a raw prompt's text) admitted together, so they
        decode as one batch."""

    def cancel(self, request_id: int) -> None: ...

    def set_mode(self, mode: str) -> None: ...

    def set_speculation(self, method: str, draft_len: int | None = None) -> None:
        """Switch speculative decoding ("off" | "ngram" | "draft" | "oracle") for later steps."""

    def request_info(self) -> None: ...

    def get_events(self, timeout: float = 0.1) -> list:
        """Every event that arrived within `timeout`, in order; may be []."""
