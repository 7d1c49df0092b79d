"""Decode-attention backends behind one interface (see base.DecodeAttention).

`get_backend(name, device)` with name in auto | triton | flash-attn | torch | sdpa. `auto` picks
triton on CUDA when Triton imports (else torch), and sdpa on CPU. Backend modules are imported
lazily, so a CPU-only install never needs triton or flash-attn.
"""

from __future__ import annotations

import importlib.util

import torch

from fgchat.engine.kernels.attention.base import DecodeAttention
from fgchat.protocol.errors import FgchatError
from fgchat.protocol.tuning import Tuning

BACKEND_NAMES: tuple[str, ...] = ("auto", "triton", "flash-attn", "torch", "sdpa")

__all__ = ["BACKEND_NAMES", "DecodeAttention", "get_backend", "triton_available"]


def triton_available() -> bool:
    """True when the triton package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def get_backend(name: str, device: torch.device, tuning: Tuning | None = None,
                head_dim: int | None = None) -> DecodeAttention:
    """Build the named backend for `device` (and the model's `head_dim` where given: auto takes
    torch on CUDA for a head dim the triton kernels lack). Raises FgchatError (one line) when it
    cannot run."""
    if name not in BACKEND_NAMES:
        raise FgchatError(f"unknown attention backend '{name}' (choose {', '.join(BACKEND_NAMES)})")
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_available() and triton_available():
            try:
                return get_backend("triton", device, tuning, head_dim)
            except FgchatError:  # triton present but unusable (e.g. a broken install): use torch
                pass
        name = "sdpa" if device.type == "cpu" else "torch"
    if name == "torch":
        from fgchat.engine.kernels.attention.torch_ref import TorchDecodeAttention

        return TorchDecodeAttention()
    if name == "sdpa":
        if device.type != "cpu":
            raise FgchatError(f"the sdpa attention backend serves CPU steps, not {device.type} (use --attention torch)")
        from fgchat.engine.kernels.attention.cpu_sdpa import SdpaDecodeAttention

        return SdpaDecodeAttention((tuning or Tuning()).cpu_attn_half)
    if name == "triton":
        if device.type != "cuda":
            raise FgchatError(f"the triton attention backend needs a CUDA device, not {device.type} (use --attention torch)")
        try:
            from fgchat.engine.kernels.attention.triton_decode import DEFAULT_CONFIGS, TritonDecodeAttention
        except ImportError as exc:
            raise FgchatError(f"triton is not importable ({exc}); use --attention torch") from exc
        if head_dim is not None and head_dim not in DEFAULT_CONFIGS:
            dims = ", ".join(str(d) for d in sorted(DEFAULT_CONFIGS))
            raise FgchatError(f"the triton attention kernels take head dim {dims}, not {head_dim} (use --attention torch)")
        return TritonDecodeAttention(device, pdl=True)
    from fgchat.engine.kernels.attention.flash import FlashAttnDecode

    return FlashAttnDecode(device)
