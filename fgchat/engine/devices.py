"""Which device and dtype the engine runs on: the --device and --dtype arguments resolved against
this machine (one-line errors for anything else). Imports nothing from the engine."""

from __future__ import annotations

import re

import torch

from fgchat.protocol.errors import FgchatError

DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def pick_device(name: str | None) -> torch.device:
    """auto (None), cpu, cuda or cuda:N; anything else (meta, mps, cuda:x, ...) is a one-line error."""
    name = name.strip() if isinstance(name, str) else name
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not DEVICE_RE.match(name):
        raise FgchatError(f"unknown device {name!r} (choose from auto, cpu, cuda, cuda:N)")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise FgchatError("CUDA was requested but no CUDA device is available")
    device = torch.device(name)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise FgchatError(f"no CUDA device {device.index}: this machine has {count} (cuda:0..cuda:{count - 1})")
    return device


def cpu_computes_bf16() -> bool:
    """Whether this CPU has the bfloat16 instructions torch's CPU matmuls use (x86 AVX512-BF16 or
    AMX); without them bfloat16 is emulated and slower than float32."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        try:
            if getattr(torch.cpu, probe)():
                return True
        except Exception:  # a torch without the probe, or a CPU it cannot query
            pass
    return False


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 on CPU (the engine's default, the tests' reference).
    "auto" (the command line's default): bfloat16 where the device computes it natively (CUDA, a
    CPU with AVX512-BF16 or AMX), else float32. The embedded model on 2 AMD EPYC cores with
    AVX512-BF16: 32 ms per token in bfloat16 against 51 in float32 (the README's CPU benchmark),
    a 527-token prompt 0.56 s against 0.93 s, and 7 of 8
    chat prompts' first 32 tokens equal to transformers' float32 (transformers' bfloat16: 5 of 8);
    the start-up check compares a reduced dtype with float32 before the first request."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "auto":
        native = device.type == "cuda" or cpu_computes_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise FgchatError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]
