"""describe.py: the weight format, the bytes weights occupy and the bytes a decode step reads,
over float tensors, QuantWeight, look-alike quantized objects and stacks of mixed parts. The
expected numbers are computed here from the shapes, independently of the walk describe does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fgchat.engine.model.decoder import DecoderWeights, LayerWeights
from fgchat.engine.quant.describe import step_read_bytes, weight_bytes, weight_format
from fgchat.engine.quant.qweight import QuantWeight

H, Q, KV, I, V, LAYERS = 64, 64, 32, 128, 256, 2


@dataclass
class FakeQuant:  # any object with .fmt and .nbytes counts as a quantized matrix
    fmt: str
    nbytes: int


@dataclass
class FakeStack:  # any object with .parts counts as a stack
    parts: list


def _float_model(dtype: torch.dtype, tied: bool, bias: bool = False) -> DecoderWeights:
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    layers = [LayerWeights(t(H), t(Q + 2 * KV, H), t(Q + 2 * KV) if bias else None, t(H, Q), t(H),
                           t(2 * I, H), t(H, I)) for _ in range(LAYERS)]
    embed = t(V, H)
    return DecoderWeights(embed, layers, t(H), embed if tied else t(V, H))


def _layer_elems(bias: bool) -> int:
    return 2 * H + (Q + 2 * KV) * H + (Q + 2 * KV if bias else 0) + H * Q + 2 * I * H + H * I


def test_float_tied_and_untied():
    for dtype, name, size in ((torch.bfloat16, "bf16", 2), (torch.float16, "fp16", 2), (torch.float32, "fp32", 4)):
        for tied in (True, False):
            for bias in (False, True):
                w = _float_model(dtype, tied, bias)
                step = (LAYERS * _layer_elems(bias) + H + V * H) * size
                assert weight_format(w) == name
                assert step_read_bytes(w) == step  # the head is read even when tied; the table is not
                assert weight_bytes(w) == step + (0 if tied else V * H * size)


def _qweight(fmt: str, n: int, k: int) -> QuantWeight:
    """A Q4_1-style (or int4) matrix with its planes' real sizes."""
    if fmt == "Q4_1":
        planes = {"d": torch.zeros(n, k // 32, dtype=torch.float16), "m": torch.zeros(n, k // 32, dtype=torch.float16),
                  "qs": torch.zeros(n, k // 2, dtype=torch.uint8)}
    else:
        planes = {"scale": torch.zeros(n, k // 128, dtype=torch.bfloat16), "qs": torch.zeros(n, k // 2, dtype=torch.uint8)}
    return QuantWeight(fmt, (n, k), planes)


def test_quantized_layers_with_a_tied_quantized_head():
    w = _float_model(torch.bfloat16, tied=True)
    for lw in w.layers:
        lw.wqkv, lw.wo = _qweight("Q4_1", Q + 2 * KV, H), _qweight("Q4_1", H, Q)
        lw.w_gate_up, lw.w_down = _qweight("Q4_1", 2 * I, H), _qweight("Q4_1", H, I)
    head = _qweight("Q4_1", V, H)
    w.embed = w.lm_head = head

    def q41(n: int, k: int) -> int:  # 32 weights: 16 bytes of nibbles + fp16 d and m
        return n * (k // 32) * 20

    per_layer = 2 * H * 2 + q41(Q + 2 * KV, H) + q41(H, Q) + q41(2 * I, H) + q41(H, I)
    step = LAYERS * per_layer + H * 2 + q41(V, H)
    assert weight_format(w) == "Q4_1"
    assert step_read_bytes(w) == step
    assert weight_bytes(w) == step  # tied: the table is the head
    # a float embedding table beside the quantized head: memory, not a step's read, not the format
    w.embed = torch.zeros(V, H, dtype=torch.bfloat16)
    assert weight_format(w) == "Q4_1" and step_read_bytes(w) == step
    assert weight_bytes(w) == step + V * H * 2


def test_mixed_formats_by_bytes_and_stacks():
    w = _float_model(torch.bfloat16, tied=False)
    for lw in w.layers:
        lw.wqkv = FakeStack([FakeQuant("Q4_K", 1000), FakeQuant("Q6_K", 300)])
        lw.wo, lw.w_gate_up, lw.w_down = FakeQuant("Q4_K", 500), FakeQuant("Q4_K", 2000), FakeQuant("Q6_K", 900)
    w.lm_head = FakeQuant("Q6_K", 5000)
    w.embed = FakeQuant("Q4_K", 7000)
    # Q6_K: 2 * (300 + 900) + 5000 = 7400 > Q4_K: 2 * 3500 = 7000 (the table is not a step's read)
    assert weight_format(w) == "Q6_K+Q4_K"
    step = LAYERS * (1000 + 300 + 500 + 2000 + 900 + 2 * H * 2) + H * 2 + 5000
    assert step_read_bytes(w) == step
    assert weight_bytes(w) == step + 7000
    w.lm_head = FakeQuant("Q6_K", 100)
    assert weight_format(w) == "Q4_K+Q6_K"
    # a tensor part left in bf16 (an unsupported type) joins the formats by its bytes
    w.layers[0].w_down = torch.zeros(H, I // 4, dtype=torch.bfloat16)  # 4096 bytes
    assert weight_format(w) == "Q4_K+bf16+Q6_K"  # 7000, 4096, 2 * 300 + 900 + 100
    w.layers[0].w_down = torch.zeros(H, I, dtype=torch.bfloat16)  # 16384 bytes
    assert weight_format(w) == "bf16+Q4_K+Q6_K"


def test_views_of_one_allocation_count_once():
    w = _float_model(torch.bfloat16, tied=False)
    base = torch.zeros(V, H, dtype=torch.bfloat16)
    w.embed, w.lm_head = base, base.view(V, H)  # another tensor object over the same memory
    assert weight_bytes(w) == step_read_bytes(w)


def test_fp8_and_int4_names():
    w = _float_model(torch.bfloat16, tied=True)
    for lw in w.layers:
        lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down = (_qweight("int4", n, k) for n, k in
                                                   ((Q + 2 * KV, H), (H, Q), (2 * I, H), (H, I)))
    # the head stays bf16: the larger of the two leads
    int4 = LAYERS * sum(n * k // 2 + n * (k // 128) * 2 for n, k in ((Q + 2 * KV, H), (H, Q), (2 * I, H), (H, I)))
    assert weight_format(w) == ("int4+bf16" if int4 > V * H * 2 else "bf16+int4")
    w.lm_head = w.embed = torch.zeros(V // 4, H, dtype=torch.bfloat16)
    assert int4 > V // 4 * H * 2 and weight_format(w) == "int4+bf16"
    w.lm_head = w.embed = torch.zeros(4 * V, H, dtype=torch.bfloat16)
    assert int4 < 4 * V * H * 2 and weight_format(w) == "bf16+int4"
    fp8 = FakeQuant("fp8", 1)
    for lw in w.layers:
        lw.wqkv = lw.wo = lw.w_gate_up = lw.w_down = fp8
    w.lm_head = FakeQuant("fp8", 10)
    assert weight_format(w) == "fp8"
    assert step_read_bytes(w) == LAYERS * 2 * H * 2 + H * 2 + 1 + 10
