"""GPU memory for weights is what describe.py reports (the issue's bound: the tensors' bytes + at
most 5%), for bf16 and for --quantize fp8 / int4 (one preset's random weights); and a whole engine's
EngineInfo on CUDA names the format, the bytes and the GPU's peak bandwidth. Prints what it
measured."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama-3.2-1b"])
@pytest.mark.parametrize("quantize", ["none", "fp8", "int4"])
def test_weight_memory_is_the_weight_bytes(preset, quantize):
    from fgchat.engine.build import load_weights
    from fgchat.engine.quant.describe import step_read_bytes, weight_bytes, weight_format
    from fgchat.protocol.config import EngineConfig

    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    loaded = load_weights(EngineConfig(preset=preset, quantize=quantize), device, torch.bfloat16)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(device) - before
    w = loaded.weights
    fmt, nbytes, step = weight_format(w), weight_bytes(w), step_read_bytes(w)
    print(f"{preset} --quantize {quantize}: weights {fmt}, {nbytes / 1e6:.1f} MB described, "
          f"{held / 1e6:.1f} MB allocated ({held / nbytes:.3f}x), a step reads {step / 1e6:.1f} MB")
    assert nbytes <= held <= 1.05 * nbytes
    if quantize != "none":
        assert quantize in fmt.split("+"), fmt
    else:
        assert fmt == "bf16"
    del loaded, w
    gc.collect()
    torch.cuda.empty_cache()


def test_engine_info_on_cuda():
    from fgchat.engine.core import Engine
    from fgchat.protocol.config import EngineConfig

    engine = Engine(EngineConfig(preset="smollm2-135m", device="cuda", max_context=256, lazy_capture=True))
    info = engine.info()
    print(f"{info.device}: weights {info.weights}, {info.weight_bytes / 1e6:.1f} MB, step {info.step_bytes / 1e6:.1f} MB, "
          f"peak {info.peak_bandwidth and info.peak_bandwidth / 1e12} TB/s; notes {info.notes}")
    assert info.weights == "bf16" and info.step_bytes <= info.weight_bytes
    assert info.peak_bandwidth is not None and info.peak_bandwidth > 1e11
    index = torch.cuda.current_device()
    assert f"weights bf16, {info.weight_bytes / 1e6:.1f} MB on cuda:{index}" in info.notes
