"""Quantized weight formats on CPU: GGUF blocks split into planes and dequantized equal gguf-py's
dequantization bit for bit; the GGUF index equals gguf-py's reader; q / k rows come back in
transformers' order; fp8 / int4 quantization keeps its bounds and its bytes are as specified."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quant_gguf_files import block_bytes, llama_cpp_permute, write_gguf

from fgchat.engine.quant.dequant import dequantize, take_rows
from fgchat.engine.quant.gguf_index import read_index
from fgchat.engine.quant.gguf_tensors import planes_from_blocks, read_gguf_weights
from fgchat.engine.quant.qweight import GGUF_FORMATS, QuantStack, QuantWeight, cat_rows, stack_rows
from fgchat.engine.quant.quantize import quantize_fp8, quantize_int4

gguf = pytest.importorskip("gguf")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_dequantize_equals_gguf_py(fmt):
    rng = np.random.default_rng(len(fmt) + ord(fmt[1]))
    rows, k = 5, 512
    raw = block_bytes(fmt, rows, k, rng)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt])
    qw = planes_from_blocks(fmt, torch.from_numpy(raw), k)
    assert qw.shape == (rows, k) and all(p.shape[0] == rows for p in qw.planes.values())
    got = dequantize(qw)
    assert got.dtype == torch.float32 and got.shape == (rows, k)
    assert np.array_equal(bits(got.numpy()), bits(want)), float(np.abs(got.numpy() - want).max())
    assert torch.equal(dequantize(qw, torch.bfloat16), torch.from_numpy(want).to(torch.bfloat16))
    # every block byte lands in a plane once (K formats: 12 packed scale bytes -> 16 sc / mn bytes)
    extra = 4 * rows * (k // 256) if fmt in ("Q4_K", "Q5_K") else 0
    assert qw.nbytes == raw.nbytes + extra


def test_gguf_index_equals_gguf_reader(tmp_path):
    """Our header reader (which skips metadata arrays) lists the tensors gguf-py's reader lists,
    with the same types, dims and bytes, and reads the scalar metadata."""
    rng = np.random.default_rng(3)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([0.5] * 300)
    writer.add_block_count(1)
    for i, fmt in enumerate(("Q4_K", "Q8_0", "Q6_K", "Q5_0")):
        writer.add_tensor(f"blk.0.t{i}.weight", block_bytes(fmt, 3 + i, 256, rng),
                          raw_dtype=gguf.GGMLQuantizationType[fmt])
    writer.add_tensor("output_norm.weight", rng.standard_normal(256).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_index(path)
    theirs = gguf.GGUFReader(path)
    assert ours.architecture == "llama" and ours.metadata["llama.block_count"] == 1
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.type_id == int(b.tensor_type) and list(a.dims) == b.shape.tolist()
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1))


def _reverse_permute_like_transformers(w: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(w, heads, kv_heads)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_read_gguf_weights_roles_rows_and_other_types(tmp_path, arch):
    """A file of mixed types: kept formats come back as planes whose values are gguf-py's, q / k
    rows in transformers' order (llama only), others dequantized and named."""
    rng = np.random.default_rng(7)
    heads, kv_heads, hd, hidden = 4, 2, 64, 256
    q_raw = block_bytes("Q8_0", heads * hd, hidden, rng)
    k_raw = block_bytes("Q4_K", kv_heads * hd, hidden, rng)
    if arch == "llama":  # the file holds llama.cpp's row order
        q_raw, k_raw = llama_cpp_permute(q_raw, heads), llama_cpp_permute(k_raw, kv_heads)
    tensors = {
        "blk.0.attn_q.weight": (q_raw, "Q8_0"),
        "blk.0.attn_k.weight": (k_raw, "Q4_K"),
        "blk.0.attn_v.weight": (block_bytes("Q6_K", kv_heads * hd, hidden, rng), "Q6_K"),
        "blk.0.ffn_down.weight": (block_bytes("Q5_0", hidden, 512, rng), "Q5_0"),
        "blk.0.attn_norm.weight": (rng.standard_normal(hidden).astype(np.float32), "F32"),
        "token_embd.weight": (rng.standard_normal((32, hidden)).astype(np.float16), "F16"),
        "rope_freqs.weight": (np.ones(hd // 2, dtype=np.float32), "F32"),
    }
    path = write_gguf(tmp_path / "m.gguf", arch, tensors)
    got = read_gguf_weights(path, heads, kv_heads)
    assert got.architecture == arch and got.other_types == {"Q5_0": 1}
    assert got.formats() == ["Q8_0", "Q4_K", "Q6_K"]
    p = "model.layers.0."
    assert set(got.tensors) == {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                p + "self_attn.v_proj.weight", p + "mlp.down_proj.weight",
                                p + "input_layernorm.weight", "model.embed_tokens.weight"}
    for name, (gname, kind) in {p + "self_attn.q_proj.weight": ("blk.0.attn_q.weight", "Q8_0"),
                                p + "self_attn.k_proj.weight": ("blk.0.attn_k.weight", "Q4_K"),
                                p + "self_attn.v_proj.weight": ("blk.0.attn_v.weight", "Q6_K")}.items():
        want = gguf.quants.dequantize(tensors[gname][0], gguf.GGMLQuantizationType[kind])
        if arch == "llama" and "v_proj" not in name:
            want = _reverse_permute_like_transformers(want, heads, heads if "q_proj" in name else kv_heads)
        qw = got.tensors[name]
        assert isinstance(qw, QuantWeight) and qw.fmt == kind
        assert np.array_equal(bits(dequantize(qw).numpy()), bits(want))
    down = got.tensors[p + "mlp.down_proj.weight"]
    want = gguf.quants.dequantize(tensors["blk.0.ffn_down.weight"][0], gguf.GGMLQuantizationType.Q5_0)
    assert isinstance(down, torch.Tensor) and np.array_equal(bits(down.numpy()), bits(want))
    embed = got.tensors["model.embed_tokens.weight"]
    assert embed.dtype == torch.float16 and np.array_equal(embed.numpy(), tensors["token_embd.weight"][0])


def _e4m3_table() -> torch.Tensor:
    """Every finite float8 e4m3fn value by its byte, from the bits (sign, 4 exponent bits of bias
    7, 3 mantissa bits; exponent 0: subnormal; 0x7f / 0xff: NaN)."""
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 15, b & 7
        v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append(float("nan") if b & 0x7F == 0x7F else sign * v)
    return torch.tensor(vals, dtype=torch.float64)


def test_fp8_bytes_and_bound():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 200, generator=g) * 0.02).to(torch.bfloat16)
    w[1, 5] = 30.0  # one outlier sets its row's scale
    w[4] = 0  # an all-zero row
    qw = quantize_fp8(w)
    x = w.double()
    absmax = x.abs().amax(dim=1)
    assert qw.planes["w"].dtype == torch.float8_e4m3fn and qw.planes["scale"].dtype == torch.float32
    assert torch.equal(qw.planes["scale"], (absmax.float() / 448))
    table = _e4m3_table()
    codes = qw.planes["w"].view(torch.uint8).long()
    decoded = table[codes]
    scale32 = qw.planes["scale"][:, None]
    target = (w.float() / torch.where(scale32 > 0, scale32, 1)).double()  # w / scale, in float32
    scale = scale32.double()
    # each byte is a nearest e4m3 value of w / scale (brute force over every finite code)
    finite = table[~torch.isnan(table)]
    nearest = (target[..., None] - finite).abs().amin(dim=-1)
    assert torch.allclose((decoded - target).abs(), nearest, rtol=0, atol=1e-12)
    err = (dequantize(qw).double() - x).abs()
    bound = torch.maximum(x.abs() / 16, scale * 2.0 ** -10) * (1 + 1e-6) + 1e-12
    assert bool((err <= bound).all()) and bool((dequantize(qw)[4] == 0).all())


def test_int4_bytes_and_bound():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(5, 384, generator=g) * 0.03).to(torch.bfloat16)
    w[2, 130] = -2.0
    w[3, 128:256] = 0  # an all-zero group
    qw = quantize_int4(w)
    scale, qs = qw.planes["scale"], qw.planes["qs"]
    assert scale.dtype == torch.bfloat16 and scale.shape == (5, 3) and qs.shape == (5, 192)
    x = w.double().view(5, 3, 128)
    assert torch.equal(scale, (x.abs().amax(dim=2).float() / 7).to(torch.bfloat16))
    b = qs.view(5, 3, 64)  # byte t of a group: its weights t (low nibble) and t + 64 (high)
    q = torch.cat((b & 15, b >> 4), dim=2).long()
    s = scale.double()[:, :, None]
    # each code is the nearest of the 16 levels (brute force), ties aside
    levels = (torch.arange(16, dtype=torch.float64) - 8) * s[..., None]  # [5, 3, 1, 16]
    dist = (x[..., None] - levels).abs()
    chosen = dist.gather(-1, q[..., None])[..., 0]
    assert torch.allclose(chosen, dist.amin(dim=-1), rtol=0, atol=1e-12)
    err = (dequantize(qw).double().view(5, 3, 128) - x).abs()
    assert bool((err <= s / 2 + 1e-12).all())
    assert bool((q[3, 1] == 8).all())
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_int4(torch.zeros(2, 576))


def test_rows_cat_stack_and_take():
    rng = np.random.default_rng(11)
    parts = [planes_from_blocks(f, torch.from_numpy(block_bytes(f, n, 256, rng)), 256)
             for f, n in (("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4))]
    fused = cat_rows(parts[:2])
    assert fused.fmt == "Q4_K" and fused.shape == (12, 256)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts[:2]]))
    stack = stack_rows(parts)
    assert isinstance(stack, QuantStack) and stack.shape == (16, 256) and stack.offsets == [0, 12, 16]
    assert stack.fmt == "Q4_K+Q6_K" and stack.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(dequantize(stack), torch.cat([dequantize(p) for p in parts]))
    assert isinstance(stack_rows(parts[:2]), QuantWeight)
    with pytest.raises(ValueError):
        cat_rows([parts[0], parts[2]])
    idx = torch.tensor([3, 0, 7, 3])
    assert torch.equal(dequantize(take_rows(parts[0], idx)), dequantize(parts[0])[idx])
