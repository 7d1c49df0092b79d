"""Which SDPA kernels the fused prefill's attention launches on the GPU: cuDNN attention builds a
plan per new shape (~40 ms), so a prefill at a length outside the buckets, several prompts at
their own lengths, and a prefill after cached rows must not reach it; each such prefill's logits
stay as close to the float32 reference as a bucketed one's.

Run on the GPU: pytest -m gpu tests/gpu/test_gpu_prefill_backends.py
"""

from __future__ import annotations

import pytest
import torch

from fgchat.engine.core import Engine, EngineConfig
from fgchat.engine.model.prefill import PREFILL_BUCKETS, prefill_after, prefill_many_fused
from test_prefix_reuse import random_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CTX = PREFILL_BUCKETS[-1] + 256


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> tuple[Engine, Engine]:
    """A bf16 engine with a context past the last bucket, and a float32 one for the reference."""
    import tiny_models

    model = str(tiny_models.head64_model(tmp_path_factory.mktemp("backends") / "m"))
    eng = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_context=CTX, mode="eager",
                              lazy_capture=True))
    w32 = Engine(EngineConfig(model=model, device="cuda", dtype="float32", max_context=CTX, mode="eager",
                              lazy_capture=True))
    assert eng.decoder.fused
    return eng, w32


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    kernel_names.out = out
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def reference(w32: Engine, ids: torch.Tensor) -> torch.Tensor:
    from fgchat.engine.model.reference import reference_logits

    d = w32.decoder
    with torch.inference_mode():
        return reference_logits(d.cfg, d.w, ids, d.cos, d.sin, d.scale)[-1]


def close_to(got: torch.Tensor, ref: torch.Tensor, bucketed_err: float) -> None:
    err = (got.float() - ref).abs().max().item()
    assert err <= 2 * bucketed_err + 1e-3, (err, bucketed_err)


def test_prefills_outside_the_buckets_launch_no_cudnn_attention_and_stay_near_float32(engines):
    eng, w32 = engines
    dec, k, v = eng.decoder, eng.cache.k, eng.cache.v
    vocab = eng.cfg.vocab_size

    bucketed = torch.tensor(random_ids(PREFILL_BUCKETS[-1], 1, vocab), device="cuda")
    names = kernel_names(lambda: dec.prefill(bucketed, 0, k, v))
    assert any("flash" in n.lower() or "cudnn" in n.lower() or "fmha" in n.lower() for n in names), names
    bucketed_err = (kernel_names.out.float() - reference(w32, bucketed)).abs().max().item()

    long = torch.tensor(random_ids(PREFILL_BUCKETS[-1] + 52, 2, vocab), device="cuda")
    names = kernel_names(lambda: dec.prefill(long, 1, k, v))
    assert not [n for n in names if "cudnn" in n.lower()], "a prompt past the last bucket reached cuDNN"
    close_to(kernel_names.out, reference(w32, long), bucketed_err)

    first = 300
    names = kernel_names(lambda: prefill_after(dec, long[first:first + 37], first, 1, k, v))
    assert not [n for n in names if "cudnn" in n.lower()], "a prefill after cached rows reached cuDNN"
    assert any("flash" in n.lower() for n in names), "a prefill after cached rows left flash's causal mode"
    close_to(kernel_names.out, reference(w32, long[:first + 37]), bucketed_err)

    prompts = [torch.tensor(random_ids(t, 3 + t, vocab), device="cuda") for t in (301, 517)]
    names = kernel_names(lambda: prefill_many_fused(dec, [(p, 2 + j) for j, p in enumerate(prompts)], k, v))
    assert not [n for n in names if "cudnn" in n.lower()], "prompts at their own lengths reached cuDNN"
    for p, got in zip(prompts, kernel_names.out):
        close_to(got, reference(w32, p), bucketed_err)

    assert torch.backends.cuda.cudnn_sdp_enabled(), "the prefill left cuDNN attention off for others"
