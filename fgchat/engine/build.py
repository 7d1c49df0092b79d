"""Construction of the engine's decode path: decoder (fused Triton stages or plain torch ops),
step buffers and program, attention backend, decode modes and their graphs; and the weights the
engine is built on. A mixin of `Engine` (engine.core), which holds the state it sets."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from fgchat.engine.loader import LoadedModel, load_model, load_random
from fgchat.engine.model.decoder import Decoder
from fgchat.engine.modes import ModeSet
from fgchat.engine.startup_trace import startup_mark
from fgchat.engine.step import StepBuffers, bind_program
from fgchat.protocol.config import EngineConfig
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.events import Mode

if TYPE_CHECKING:
    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.model.config import ModelConfig
    from fgchat.engine.prefix_reuse import SlotHistory
    from fgchat.protocol.tuning import Tuning


def load_weights(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The weights `config` names: a preset's random weights, else the model it resolves to."""
    if config.preset:
        return load_random(config.preset, device, dtype, config.seed, config.outliers, config.quantize)
    return load_model(config.model, device, dtype, config.quantize, config.dequantize)


class EngineBuild:
    """Builds (and rebuilds, on plain torch ops) the decode path of an engine."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    tuning: Tuning
    cfg: ModelConfig
    model: LoadedModel
    max_context: int
    cache: KVCache
    history: SlotHistory
    notes: list[str]
    mode: Mode

    def _build(self, fused: bool) -> None:
        """The decode path: decoder (fused Triton stages or plain torch ops), step program,
        attention backend, launch lists and graphs (captured here unless lazy)."""
        self.history.clear()  # kernel warm-up and captures below run steps on stale inputs
        self.decoder = Decoder(self.cfg, self.model.weights, self.max_context, fused, self.tuning)
        # a step's tokens feed the next step and reach the host through one kernel (fused.advance)
        self._advance_on_device = fused
        if self._advance_on_device:
            from fgchat.engine.kernels.fused import advance

            self._advance = advance
        self.bufs = StepBuffers(self.device, self.cfg.num_heads, self.cfg.head_dim, self.dtype)
        self.attention, self.attention_name = self._pick_attention(self.config.attention)
        self.program = bind_program(self.decoder, self.cache, self.bufs, self.attention,
                                    self.attention_name == "triton")
        c = self.cfg
        self.attention_label = self.attention.label(self.dtype, c.num_heads, c.num_kv_heads, c.head_dim)
        self.modes = self._make_modes()
        startup_mark("engine: decode path set up")
        if self.config.lazy_capture:
            return
        if self.tuning.idle_capture:
            try:
                first = Mode(self.config.mode or Mode.FULL)
            except ValueError:  # set_mode reports it
                first = Mode.FULL
            self.modes.capture_start(self.config.self_check, first)
        else:
            self.modes.capture_all(self.config.self_check)
        startup_mark("engine: warmed and captured")

    def _make_modes(self) -> ModeSet:
        return ModeSet(self.program, self.notes.append)

    def use_plain_path(self) -> None:
        """Drop the fused path (its graphs and pools) and rebuild on plain torch ops; the mode
        stays where it was when the new graphs allow it. The KV cache and weights are kept."""
        mode = self.mode
        self.modes.drop_all()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._build(False)
        self.mode = mode if not self.modes.unavailable.get(mode) else Mode.EAGER

    def _kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.6)
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 8 * 2**30
        return int(avail * 0.25)

    def _use_fused(self) -> bool:
        if self.device.type != "cuda":
            return False
        import importlib.util

        from fgchat.engine.model.families import fused_note

        note = fused_note(self.cfg)  # an architecture whose ops the fused kernels lack
        if note is not None:
            self.notes.append(note)
            return False
        return self.tuning.fused and importlib.util.find_spec("triton") is not None

    def _pick_attention(self, name: str):
        from fgchat.engine.kernels.attention import get_backend

        try:
            backend = get_backend(name, self.device, self.tuning, self.cfg.head_dim)
        except FgchatError as exc:
            if name in ("auto", "torch"):
                raise
            self.notes.append(f"{exc}; falling back to auto")
            backend = get_backend("auto", self.device, self.tuning, self.cfg.head_dim)
        return backend, backend.name
