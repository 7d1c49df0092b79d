"""Endpoint URLs: the OpenAI base URL (ends in /v1, as OpenAI clients take it) and the server root."""

from __future__ import annotations

from urllib.parse import urlsplit


def base_url(text: str) -> str:
    """`text` as an http(s) base URL without a trailing slash; a bare host gets `/v1`.
    Raises ValueError (one line) for anything else."""
    url = text.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {text!r} (e.g. http://127.0.0.1:8000/v1)")
    if parts.query or parts.fragment:
        raise ValueError(f"the endpoint URL takes no query or fragment: {text!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"invalid port in {text!r}") from None
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


def root_url(base: str) -> str:
    """The server root under which fgchat's own routes (/fgchat/info, /fgchat/mode) live."""
    return base[: -len("/v1")] if base.endswith("/v1") else base
