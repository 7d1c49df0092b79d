"""Request bodies of the OpenAI-compatible endpoints, parsed strictly, and their SamplingParams.

Invariants:
- A body is a JSON object of at most MAX_BODY_BYTES; NaN/Infinity are not JSON; every string in it
  (keys too) is valid Unicode: a lone surrogate escape ("\\ud800") is a 400 naming its field.
- Unknown fields are rejected (400), never silently ignored; so are values of the wrong type
  (strict: "2" is not an int, "yes" not a bool; an int is a valid float).
- Features the server does not have (logprobs, content parts other than text, stored
  completions, structured output) are a 400 that names them when asked for, and accepted when a
  client sends their off value (false, null, 0, response_format text). Fields that only qualify
  such a feature (metadata for stored completions, parallel_tool_calls for tools) are accepted.
- Unset sampling fields take the model's defaults (EngineInfo.sampling_defaults); an unset seed
  is drawn at random, so that repeated requests at temperature > 0 differ, as with OpenAI.
  Choice i of a request with seed s uses seed s + i (mod 2^63), as the TUI's K replies do
  (`fgchat generate --n` refuses a seed whose completions would wrap).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fgchat.protocol.errors import RequestError
from fgchat.protocol.events import SEED_SPACE, SamplingParams
from fgchat.serve.errors import ApiError

MAX_BODY_BYTES = 1 << 20
MAX_N = 8  # one request's choices run as one batch; the engine batches up to 8
MAX_STOPS = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type '{kind}' are not supported (text only)")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(_Strict):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM) or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    user: str | None = None
    logprobs: bool | int | None = None  # chat: a bool; completions: an int
    top_logprobs: int | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, defaults: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per choice, validated; a bad value is ApiError 400."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", param="stream_options")
        for key in ("logprobs", "top_logprobs"):
            if getattr(self, key):
                raise ApiError(400, f"{key} is not supported by this server", param=key)
        over: dict[str, Any] = {}
        for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, key)
            if value is not None:
                over[key] = float(value)
        if self.top_k is not None:
            over["top_k"] = max(0, self.top_k)
        if self.max_tokens is not None:
            over["max_tokens"] = self.max_tokens
        if self.ignore_eos:
            over["ignore_eos"] = True
        if self.seed is not None and not 0 <= self.seed < SEED_SPACE:
            raise ApiError(400, f"seed must be in [0, 2^63), got {self.seed}", param="seed")
        seed = self.seed if self.seed is not None else secrets.randbelow(SEED_SPACE)
        out = [dataclasses.replace(defaults, **over, seed=(seed + i) % SEED_SPACE) for i in range(self.n)]
        try:
            out[0].validate()
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        return out


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None

    def chat(self) -> list[dict[str, str]]:
        """The messages as the engine takes them (developer is OpenAI's newer name for system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    def sampling(self, defaults: SamplingParams) -> list[SamplingParams]:
        if self.store:
            raise ApiError(400, "store is not supported by this server (completions are not stored)",
                           param="store")
        if self.response_format is not None and self.response_format.type != "text":
            raise ApiError(400, f"response_format type '{self.response_format.type}' is not supported "
                           "(text only)", param="response_format")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(defaults)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False

    def text(self) -> str:
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, "prompt must be one string (batched prompts are not supported)",
                               param="prompt")
            return self.prompt[0]
        return self.prompt


class ModeRequest(_Strict):
    mode: str


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ApiError 400."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_unicode(body, "")
    return body


def _check_unicode(value: Any, where: str) -> None:
    """ApiError 400 naming the first string under `value` (at path `where`, "" for the body) that
    is not valid Unicode: JSON's \\uXXXX escapes can spell a lone surrogate, which no encoding takes."""
    if isinstance(value, str):
        _valid_text(value, where, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _valid_text(key, f"a field name in {where or 'the body'}", where)
            _check_unicode(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}.{i}")


def _valid_text(text: str, what: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{what} is not valid Unicode: it contains a lone surrogate "
                       f"(\\u{ord(text[exc.start]):04x}) at character {exc.start}; text must be UTF-8 "
                       "(or escaped surrogate pairs)", param=where or None) from None


def parse_model(cls: type[BaseModel], body: dict[str, Any]) -> Any:
    """`cls` validated from body; the first problem becomes one ApiError 400 line."""
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            raise ApiError(400, f"unknown field '{loc}'", param=loc) from None
        if err.get("type") == "missing":
            raise ApiError(400, f"missing field '{loc}'", param=loc) from None
        if err.get("type") == "value_error":  # a validator's own message, without pydantic's prefix
            raise ApiError(400, f"{loc}: {err['ctx']['error']}", param=loc or None) from None
        raise ApiError(400, f"{loc}: {err.get('msg', 'invalid value')}", param=loc or None) from None
