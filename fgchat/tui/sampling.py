"""What the app asks the engine for: the model's sampling defaults overridden by the user's
choices, K replies per prompt, and thinking (the chat template's `enable_thinking`: the setting
"thinking", true, false or null for the template's default).

Effective sampling = the model's defaults (`EngineInfo.sampling_defaults`, from its
generation_config.json; built-in greedy until the engine reports, and for models without one)
with the user's overrides applied, plus the caller's max_tokens / ignore_eos.

Invariants:
- Settings hold only what the user chose: "sampling_overrides" maps a field of USER_FIELDS to
  its value, for the fields that differ from the model's defaults when the user saved (F6). A
  field saved at the model's value is no override: it follows the model (also a later model's).
- An override always wins over the model's default, whenever the defaults arrive.
- Settings of fgchat before model defaults ("sampling", all four fields always written) are read
  once as overrides of the fields that differ from the built-in greedy values they were edited
  from, then removed.
- K > 1 replies with an effective temperature of 0 (greedy) would be K copies: they are sampled
  at K_TEMPERATURE instead, with the effective top-p, top-k, penalties and seeds (`reply_params`).
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

from fgchat.protocol.events import SEED_SPACE, SamplingParams
from fgchat.tui.thinking import SETTING_KEY as THINKING_KEY

MAX_SAMPLES = 8  # the engine batches at most 8 sequences
K_TEMPERATURE = 0.7  # temperature of K > 1 replies when the effective one is 0 (greedy)
# what the user may set (F6); max_tokens / ignore_eos belong to the caller
USER_FIELDS: tuple[str, ...] = (
    "temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
)
SETTINGS_KEY = "sampling_overrides"
LEGACY_KEY = "sampling"


def reply_params(base: SamplingParams, k: int) -> tuple[list[SamplingParams], str]:
    """The sampling parameters of the K replies asked for together, and a note ("" when none).

    Reply j (0-based) uses seed `(base.seed + j) % SEED_SPACE` (as the server's choices do), so
    the K replies differ from each other and every run of the same prompt and settings gives the
    same K. K = 1 keeps `base` as it is.
    K > 1 with temperature 0 (greedy) would give K identical copies, so the K replies are sampled
    at K_TEMPERATURE (0.7) instead, with base's other fields; the note says so.
    """
    k = max(1, int(k))
    if k == 1:
        return [base], ""
    note = ""
    if base.temperature == 0:
        base = replace(base, temperature=K_TEMPERATURE)
        note = f"K={k}: sampled at T {K_TEMPERATURE:g} (greedy gives K copies)"
    return [replace(base, seed=(base.seed + j) % SEED_SPACE) for j in range(k)], note


def _coerce(name: str, value: Any) -> float | int:
    kind = {f.name: f.type for f in fields(SamplingParams)}[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is not a number")
    if "int" in str(kind):
        if isinstance(value, float) and not value.is_integer():  # an int is exact at any size
            raise ValueError(f"{name} is not a whole number")
        return int(value)
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} is not finite")
    return float(value)


class SamplingChoice:
    """The model's defaults, the user's overrides and K; `params` is what the next replies use.

    `settings` is a `fgchat.tui.store.Settings` (get / set); invalid saved values are dropped
    and listed in `problems` (one line each) for the app to show.
    """

    def __init__(self, settings, request: SamplingParams) -> None:
        self._settings = settings
        self.max_tokens = request.max_tokens
        self.ignore_eos = request.ignore_eos
        self.defaults = SamplingParams()
        self.source = ""  # where `defaults` came from; "" = built-in greedy
        self.known = False  # the engine reported its model's defaults
        self.problems: list[str] = []
        self.overrides: dict[str, float | int] = self._load()
        self.samples = int(min(max(int(settings.get("samples", 1) or 1), 1), MAX_SAMPLES))

    # ---- state --------------------------------------------------------------------------
    def _load(self) -> dict[str, float | int]:
        saved = self._settings.get(SETTINGS_KEY)
        legacy = self._settings.get(LEGACY_KEY)
        if saved is None and isinstance(legacy, dict):
            greedy = SamplingParams()
            saved = {k: v for k, v in legacy.items() if k in USER_FIELDS and v != getattr(greedy, k)}
        if saved is None:
            return {}
        try:
            if not isinstance(saved, dict):
                raise ValueError("not a table of fields")
            overrides = {k: _coerce(k, v) for k, v in saved.items() if k in USER_FIELDS}
            replace(SamplingParams(), **overrides).validate()
        except Exception as exc:
            self.problems.append(f"saved sampling settings ignored: {' '.join(str(exc).split())}")
            return {}
        if legacy is not None:
            self._settings.set(SETTINGS_KEY, overrides)
            self._settings.set(LEGACY_KEY, None)
        return overrides

    @property
    def params(self) -> SamplingParams:
        """The effective sampling of the next replies (before the K rule)."""
        return replace(self.defaults, **self.overrides, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)

    def set_defaults(self, defaults: SamplingParams, source: str) -> None:
        """The model's defaults (from EngineInfo); the user's overrides still apply on top."""
        self.defaults = replace(defaults, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)
        self.source = source
        self.known = True

    def set_user(self, params: SamplingParams) -> None:
        """The user saved `params` (F6 or the palette): validated, then the fields that differ
        from the model's defaults become the overrides (saved); the others follow the model."""
        params.validate()
        self.overrides = {k: getattr(params, k) for k in USER_FIELDS if getattr(params, k) != getattr(self.defaults, k)}
        self._settings.set(SETTINGS_KEY, dict(self.overrides))

    def reset(self) -> None:
        """Back to the model's defaults: no overrides."""
        self.overrides = {}
        self._settings.set(SETTINGS_KEY, {})

    @property
    def thinking(self) -> bool | None:
        """enable_thinking for the chats sent (None: the template's default); a saved value of
        another type is ignored by Settings."""
        return self._settings.get(THINKING_KEY)

    def set_thinking(self, value: bool | None) -> None:
        self._settings.set(THINKING_KEY, value)

    def set_samples(self, k: int) -> None:
        self.samples = min(max(int(k), 1), MAX_SAMPLES)
        self._settings.set("samples", self.samples)

    def replies(self) -> tuple[list[SamplingParams], str]:
        """The K replies' parameters and the K-rule note (see `reply_params`)."""
        return reply_params(self.params, self.samples)

    # ---- text ---------------------------------------------------------------------------
    def source_label(self) -> str:
        """Where the effective values come from, e.g. "generation_config.json", "settings +
        generation_config.json", "greedy default"."""
        model = self.source or ("greedy default" if self.known else "greedy until the model loads")
        if not self.overrides:
            return model
        return f"settings + {self.source}" if self.source else "settings"

    def label(self) -> str:
        """e.g. "T 0.7 top-p 0.8 top-k 20 seed 0 rep 1.1 · generation_config.json"; "T 0.7 (K>1)"
        when the user's T is 0 and K > 1 replies are sampled at 0.7 instead; penalties only when
        they act."""
        p = self.params
        t = f"T {p.temperature:g}"
        if self.samples > 1 and p.temperature == 0:
            t = f"T {K_TEMPERATURE:g} (K>1)"
        parts = [t, f"top-p {p.top_p:g}", f"top-k {p.top_k}", f"seed {p.seed}"]
        if p.repetition_penalty != 1.0:
            parts.append(f"rep {p.repetition_penalty:g}")
        if p.presence_penalty:
            parts.append(f"pres {p.presence_penalty:g}")
        if p.frequency_penalty:
            parts.append(f"freq {p.frequency_penalty:g}")
        return f"{' '.join(parts)} · {self.source_label()}"
