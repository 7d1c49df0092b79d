"""The engine process behind `fgchat serve`: `EngineProcess` that also takes raw prompts.

The engine's commands carry chat messages only, but `/v1/completions` must feed its prompt to the
tokenizer without the chat template. A message list of exactly one message whose role is
`RAW_ROLE` carries such a prompt: in the child, the engine's tokenizer is wrapped so that this list
is encoded as plain text (with the model's BOS, as `fgchat generate --raw` does) and every other
list goes through the chat template unchanged.

Invariants:
- RAW_ROLE is not a role a client can send: the request schema admits only OpenAI's roles.
- Only the spawned child is changed (its own copy of `fgchat.engine.core`); the server process
  never imports torch or the engine core.
"""

from __future__ import annotations

from typing import Any

from fgchat.engine.process import EngineProcess

RAW_ROLE = "fgchat.raw_prompt"


def raw_prompt_messages(prompt: str) -> list[dict[str, str]]:
    """The message list that stands for a raw (untemplated) prompt."""
    return [{"role": RAW_ROLE, "content": prompt}]


class RawPromptTokenizer:
    """Delegates to the engine's tokenizer; encodes a raw-prompt message list as plain text."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        if len(messages) == 1 and messages[0].get("role") == RAW_ROLE:
            return self._inner.encode(str(messages[0].get("content", "")), add_special_tokens=True)
        return self._inner.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _child_main(config: Any, commands: Any, events: Any, log_path: str | None) -> None:
    """Spawned entry point: the stock child loop, over an engine whose tokenizer takes raw prompts."""
    from fgchat.engine import core, process

    base = core.Engine

    class RawPromptEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.tokenizer is not None:
                self.tokenizer = RawPromptTokenizer(self.tokenizer)

    core.Engine = RawPromptEngine  # this child's module only; _process_main looks it up per call
    process._process_main(config, commands, events, log_path)


class ServeEngineProcess(EngineProcess):
    """EngineProcess whose child also accepts `raw_prompt_messages(...)` as a prompt."""

    def _start(self) -> None:
        self._commands = self._ctx.Queue()
        self._reader, writer = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=_child_main, name="fgchat-serve-engine", daemon=True,
                                       args=(self.config, self._commands, writer, self.log_path))
        self._proc.start()
        writer.close()  # only the child writes: its death closes the pipe
