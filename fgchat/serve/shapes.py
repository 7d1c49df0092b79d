"""OpenAI response shapes: streamed chunks (SSE) and whole responses, chat and text completions.

Invariants:
- Every chunk is one `data: <json>\\n\\n` SSE event; a stream ends with `data: [DONE]`.
- The first chunk of each chat choice carries `delta.role = "assistant"`.
- fgchat's per-token timing rides in a top-level `fgchat` field that OpenAI clients ignore.
- A choice that failed ends with finish_reason "error" and its error, OpenAI-shaped, in the
  choice's own `error` field (clients read it or ignore it); a top-level `error` (which the openai
  client raises) is only sent by `error_chunk`, for a request whose every choice failed.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from fgchat.serve.choices import Choices, Delta
from fgchat.serve.errors import error_body

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finite(obj: Any) -> Any:
    """obj with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def engine_error(message: str) -> dict[str, Any]:
    """The error object of a choice that the engine failed."""
    return error_body(503, message, code="engine_error")["error"]


class Shaper:
    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._role_sent: set[int] = set()

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, d: Delta) -> str:
        if self.chat:
            delta: dict[str, Any] = {}
            if d.index not in self._role_sent:
                self._role_sent.add(d.index)
                delta["role"] = "assistant"
            if d.text or d.finish_reason is None:
                delta["content"] = d.text
            choice = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": d.finish_reason}
            obj = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
            obj = {**self._head("text_completion"), "choices": [choice]}
        if d.error is not None:
            choice["error"] = engine_error(d.error)
        if d.timing is not None:
            obj["fgchat"] = d.timing
        return sse(obj)

    def error_chunk(self, message: str) -> str:
        """The request failed as a whole: OpenAI's mid-stream error event."""
        return sse(error_body(503, message, code="engine_error"))

    def usage_chunk(self, choices: Choices) -> str:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return sse({**head, "choices": [], "usage": choices.usage()})

    def whole(self, choices: Choices) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices.items):
            text = "".join(c.text)
            body: dict[str, Any] = ({"message": {"role": "assistant", "content": text}} if self.chat
                                    else {"text": text})
            out.append({"index": i, **body, "logprobs": None, "finish_reason": c.finish_reason})
            if c.error is not None:
                out[-1]["error"] = engine_error(c.error)
        obj = self._head("chat.completion" if self.chat else "text_completion")
        return finite({**obj, "choices": out, "usage": choices.usage(),
                       "fgchat": {"choices": [c.summary for c in choices.items]}})
