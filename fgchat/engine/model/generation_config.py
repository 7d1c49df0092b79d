"""A model's own sampling defaults, read from the generation_config.json next to its weights.

Invariants:
- `read_generation_config` never raises for a bad file. Missing file: ({}, ""). Unreadable,
  not UTF-8, not JSON or not a JSON object: ({}, note). Otherwise the dict holds only
  SAMPLING_KEYS whose values are of transformers' type and in the range fgchat accepts; every
  other key (eos ids, transformers bookkeeping, max_new_tokens, ...) is left out silently, and a
  sampling key with a bad value is left out and named in the note.
- A note is one line that names the file, says what was ignored and what is used instead.
- `SamplingParams.from_generation_config(values)` of a returned dict always passes
  `SamplingParams.validate()`, so entry points can start from it without re-checking.
- `do_sample: true` without a (valid) temperature gets transformers' default temperature 1.0 in
  the dict, so the model samples as transformers would; top_k is taken only when the file sets it
  (as vLLM does), not transformers' implicit 50.
- An empty dict means "the model states no sampling": the engine then reports built-in greedy
  (EngineInfo.sampling_source == ""). A non-empty dict means the model states something, even if
  that is greedy (`do_sample: false`). The embedded model is the one exception: when its file
  states nothing, the loader takes EMBEDDED_SAMPLING (source EMBEDDED_SAMPLING_SOURCE).
- Torch-free: entry points may import this module before any model loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fgchat.protocol.events import SamplingParams

FILE_NAME = "generation_config.json"

# The embedded SmolLM2-135M-Instruct states no sampling (its generation_config.json has none, and
# greedy replies loop on long answers); its model card recommends these. They apply only when the
# file states nothing, and are reported with EMBEDDED_SAMPLING_SOURCE as their source.
EMBEDDED_SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
EMBEDDED_SAMPLING_SOURCE = "SmolLM2 model card"

# transformers' GenerationConfig keys that SamplingParams.from_generation_config reads
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _check(key: str, v: Any) -> tuple[Any, str]:
    """(the value to keep, "") or (None, why it is not kept)."""
    if key == "do_sample":
        return (v, "") if isinstance(v, bool) else (None, "must be true or false")
    if key == "top_k":
        if isinstance(v, float) and v.is_integer():  # 20.0 from a hand-written file
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            return None, "must be an integer"
        return (v, "") if v >= 0 else (None, "must be >= 0")
    x = _number(v)
    if x is None:
        return None, "must be a number"
    if key == "temperature":
        return (x, "") if 0.0 <= x <= 100.0 else (None, "must be between 0 and 100")
    if key == "top_p":
        return (x, "") if 0.0 < x <= 1.0 else (None, "must be in (0, 1]")
    if key == "repetition_penalty":
        return (x, "") if 0.0 < x <= 10.0 else (None, "must be in (0, 10]")
    raise KeyError(key)


def parse_generation_config(raw: Any) -> tuple[dict[str, Any], list[str]]:
    """The sane sampling keys of a parsed generation_config.json (see the module's invariants), and
    "key=value (why)" for each sampling key that was left out."""
    if not isinstance(raw, dict):
        return {}, ["expected a JSON object"]
    out: dict[str, Any] = {}
    bad: list[str] = []
    for key in SAMPLING_KEYS:
        if key not in raw or raw[key] is None:  # transformers writes null for "unset"
            continue
        value, why = _check(key, raw[key])
        if why:
            bad.append(f"{key}={json.dumps(raw[key])[:40]} ({why})")
        else:
            out[key] = value
    if out.get("do_sample") and "temperature" not in out:
        out["temperature"] = 1.0  # transformers' GenerationConfig default
    return out, bad


def read_generation_config(model_dir: str | Path) -> tuple[dict[str, Any], str]:
    """(sampling keys of model_dir/generation_config.json, a one-line note or "")."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return {}, ""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return {}, f"cannot read {FILE_NAME} ({type(e).__name__}); using greedy sampling"
    except json.JSONDecodeError as e:
        return {}, f"{FILE_NAME} is not valid JSON (line {e.lineno}); using greedy sampling"
    if not isinstance(raw, dict):
        return {}, f"{FILE_NAME} is not a JSON object; using greedy sampling"
    values, bad = parse_generation_config(raw)
    if bad:
        return values, f"{FILE_NAME}: ignored {', '.join(bad)}; using the built-in defaults for these"
    return values, ""


def describe_sampling(p: SamplingParams) -> str:
    """A short, stable text of the sampling a request runs with, e.g. "greedy, repetition 1.1" or
    "T 0.7 top-p 0.8 top-k 20, repetition 1.05"; penalties appear only when they are active."""
    if p.temperature == 0:
        parts = ["greedy"]
    else:
        s = f"T {p.temperature:g}"
        if p.top_p < 1:
            s += f" top-p {p.top_p:g}"
        if p.top_k > 0:
            s += f" top-k {p.top_k}"
        parts = [s]
    if p.repetition_penalty != 1.0:
        parts.append(f"repetition {p.repetition_penalty:g}")
    if p.presence_penalty != 0.0:
        parts.append(f"presence {p.presence_penalty:g}")
    if p.frequency_penalty != 0.0:
        parts.append(f"frequency {p.frequency_penalty:g}")
    return ", ".join(parts)
