"""OpenAI-shaped HTTP errors for `fgchat serve`.

Invariant: every error the server answers has the body
`{"error": {"message": <one line>, "type": ..., "param": ..., "code": ...}}`, whatever raised it.
"""

from __future__ import annotations

from typing import Any

from fgchat.stdio import one_line

# status -> OpenAI's error type
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered to the client as JSON with `status`; message is one line."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = one_line(message)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": one_line(message), "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code if code is not None else status}}
