"""EngineInfo for a remote endpoint: rebuilt from fgchat's /fgchat/info JSON, or a stand-in for
any other OpenAI-compatible server (every mode unavailable: "not an fgchat server"; its mode is
REMOTE_MODE, as nothing says how it runs).

Invariant: the result always has `endpoint` set to the base URL, so the UI knows its timings are
measured at the client.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fgchat.protocol.events import MODES, REMOTE_MODE, CaptureReport, EngineInfo, Mode, SamplingParams, StartupCheck

NOT_FGCHAT = "not an fgchat server"


def _build(cls: type, data: Any) -> Any:
    """cls(**data) with only the fields cls knows (a newer server may send more)."""
    if not isinstance(data, dict):
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def info_from_json(data: dict[str, Any], endpoint: str) -> EngineInfo:
    """EngineInfo from an fgchat server's /fgchat/info; ValueError/TypeError when it is not one."""
    kw = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(EngineInfo)}}
    kw["mode"] = Mode(kw.get("mode", "eager"))
    kw["captures"] = [c for c in (_build(CaptureReport, x) for x in kw.get("captures") or []) if c]
    for c in kw["captures"]:
        c.mode = Mode(c.mode)
    kw["startup_check"] = _build(StartupCheck, kw.get("startup_check"))
    kw["sampling_defaults"] = _build(SamplingParams, kw.get("sampling_defaults")) or SamplingParams()
    kw["available_modes"] = {str(k): str(v) for k, v in (kw.get("available_modes") or {}).items()}
    kw["endpoint"] = endpoint
    return EngineInfo(**kw)


def stand_in_info(model_name: str, endpoint: str, max_context: int = 0) -> EngineInfo:
    """What is known of a server that is not fgchat: its model name and URL."""
    return EngineInfo(
        model_name=model_name, architecture="remote", device=endpoint, dtype="unknown",
        max_context=max_context, num_layers=0, attention_backend="remote",
        available_modes={str(m): NOT_FGCHAT for m in MODES}, mode=REMOTE_MODE,
        notes=[f"{endpoint} is not an fgchat server: timings are measured at the client, modes are its own"],
        endpoint=endpoint,
    )
