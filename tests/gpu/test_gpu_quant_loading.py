"""Quantized weights loaded on the GPU (no kernels run): the embedded GGUF keeps its Q4_1 / Q8_0
blocks as QuantWeight with the file's bytes (+ <= 5%), the float32 reference over them equals the
CPU's over the dequantized copy; --quantize fp8 / int4 of a preset's random weights hold their
planes on the GPU. Prints what it measured."""

from __future__ import annotations

import pytest
import torch
from test_gpu_real_weights import real_model  # the embedded GGUF, or FGCHAT_REAL_GGUF's

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def test_embedded_gguf_blocks_on_gpu():
    from fgchat.engine.loader import load_model
    from fgchat.engine.quant.describe import weight_bytes
    from fgchat.engine.model.reference import reference_logits
    from fgchat.engine.quant.gguf_index import read_index
    from fgchat.engine.quant.qweight import QuantWeight

    path = real_model()
    if path is None:
        pytest.skip("the embedded GGUF is not installed")
    gpu = load_model(path, CUDA, torch.bfloat16)
    w = gpu.weights
    assert gpu.weight_format == "Q4_1+Q8_0" and gpu.notes == []
    assert all(isinstance(getattr(lw, n), QuantWeight) and getattr(lw, n).device.type == "cuda"
               for lw in w.layers for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(w.embed, QuantWeight) and w.embed.fmt == "Q8_0" and w.lm_head is w.embed
    file_bytes = sum(t.data.nbytes for t in read_index(path).tensors)
    held = weight_bytes(w)
    print(f"\nembedded Q4_1 on GPU: weights {held / 2**20:.2f} MiB, file tensors {file_bytes / 2**20:.2f} MiB")
    assert held <= file_bytes * 1.05
    cpu = load_model(path, torch.device("cpu"), torch.float32)
    ids = torch.tensor([1, 504, 3458, 314, 260, 3575, 282, 4649, 47], device=CUDA)
    from fgchat.engine.model.decoder import Decoder

    dec = Decoder(cpu.cfg, cpu.weights, 64)
    want = reference_logits(cpu.cfg, cpu.weights, ids.cpu(), dec.cos, dec.sin, dec.scale)
    got = reference_logits(gpu.cfg, w, ids, dec.cos.to(CUDA), dec.sin.to(CUDA), dec.scale).cpu()
    err = float((got - want).norm() / want.norm())
    print(f"float32 reference, GPU over planes vs CPU over dequantized copies: rel L2 {err:.2e}")
    assert err < 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantize_preset_on_gpu(fmt):
    from fgchat.engine.loader import load_random
    from fgchat.engine.quant.describe import weight_bytes
    from fgchat.engine.quant.qweight import QuantWeight

    plain = load_random("llama-3.2-1b", CUDA, torch.bfloat16)
    before = weight_bytes(plain.weights)
    del plain
    q = load_random("llama-3.2-1b", CUDA, torch.bfloat16, quantize=fmt)
    lw = q.weights.layers[0]
    assert set(q.weight_format.split("+")) == {fmt, "bf16"} and q.notes == []  # by bytes: the bf16 head may lead
    assert isinstance(lw.wqkv, QuantWeight) and lw.wqkv.device.type == "cuda"
    assert isinstance(q.weights.embed, torch.Tensor) and q.weights.embed.dtype == torch.bfloat16
    print(f"\nllama-3.2-1b {fmt}: weights {weight_bytes(q.weights) / 2**30:.3f} GiB (bf16 {before / 2**30:.3f} GiB)")
