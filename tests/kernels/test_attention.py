"""Decode-attention backends: torch reference vs a naive loop (CPU), backend selection, and on a
GPU the Triton split-K kernel vs the torch reference, eagerly and inside CUDA graphs."""

from __future__ import annotations

import math
import sys
import time

import pytest
import torch

from fgchat.engine.kernels.attention import BACKEND_NAMES, get_backend
from fgchat.engine.kernels.attention.base import plan_num_splits
from fgchat.engine.kernels.attention import cpu_sdpa
from fgchat.engine.kernels.attention.cpu_sdpa import SdpaDecodeAttention
from fgchat.engine.kernels.attention.torch_ref import TorchDecodeAttention
from fgchat.protocol.errors import FgchatError

SLOTS = 8


# ----------------------------------------------------------------------------- helpers


def make_inputs(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_context: int,
    seq_lens: list[int],
    dtype: torch.dtype,
    device: str | torch.device,
    gen: torch.Generator,
    poison: bool = True,
) -> dict[str, torch.Tensor]:
    """Random q/caches; each lane gets a distinct random slot. With poison=True every cache
    position a lane must NOT read (beyond its seq_len, or in slots nobody reads) holds NaN."""
    num_q_heads = num_kv_heads * group
    shape = (SLOTS, max_context, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((batch, num_q_heads, head_dim), generator=gen).to(dtype)
    slots = torch.randperm(SLOTS, generator=gen)[:batch]
    if poison:
        keep = torch.zeros((SLOTS, max_context), dtype=torch.bool)
        for slot, n in zip(slots.tolist(), seq_lens):
            keep[slot, :n] = True
        k_cache[~keep] = float("nan")
        v_cache[~keep] = float("nan")
    return {
        "q": q.to(device),
        "k_cache": k_cache.to(device),
        "v_cache": v_cache.to(device),
        "slot_ids": slots.to(torch.int32).to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32).to(device),
    }


def naive_attention(inputs: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """Per-lane, per-head loop in float64: the obviously-correct definition."""
    q = inputs["q"].cpu().double()
    k_cache, v_cache = inputs["k_cache"].cpu().double(), inputs["v_cache"].cpu().double()
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros((batch, num_q_heads, head_dim), dtype=torch.float64)
    for lane in range(batch):
        slot = int(inputs["slot_ids"][lane])
        n = int(inputs["seq_lens"][lane])
        for head in range(num_q_heads):
            k = k_cache[slot, :n, head // group]  # [n, D]
            v = v_cache[slot, :n, head // group]
            weights = torch.softmax(k @ q[lane, head] * scale, dim=0)
            out[lane, head] = weights @ v
    return out


def reference(inputs: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The torch backend in fp32 on fp32 copies of the inputs (the GPU tests' oracle)."""
    f32 = {name: (t.float() if t.is_floating_point() else t) for name, t in inputs.items()}
    out = torch.empty_like(f32["q"])
    TorchDecodeAttention()(**f32, out=out, scale=scale)
    return out


def assert_close_finite(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "NaN/inf in attention output"
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- CPU: torch backend


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_torch_backend_matches_naive_loop(group: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(1000 * group + head_dim)
    max_context = 97
    for seq_lens in ([1], [97], [1, 50, 97], [13, 1, 64, 97, 2, 96, 40, 7]):
        inputs = make_inputs(len(seq_lens), 2, group, head_dim, max_context, seq_lens, torch.float32, "cpu", gen)
        scale = 1.0 / math.sqrt(head_dim)
        out = torch.empty_like(inputs["q"])
        TorchDecodeAttention()(**inputs, out=out, scale=scale)
        assert_close_finite(out, naive_attention(inputs, scale), torch.float32)


def test_torch_backend_max_len_hint_does_not_change_result() -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = [5, 33, 2]
    inputs = make_inputs(3, 4, 2, 64, 512, seq_lens, torch.float32, "cpu", gen)
    full, hinted = torch.empty_like(inputs["q"]), torch.empty_like(inputs["q"])
    backend = TorchDecodeAttention()
    backend(**inputs, out=full, scale=0.125)
    backend(**inputs, out=hinted, scale=0.125, max_len_hint=max(seq_lens))
    assert torch.isfinite(full).all()
    torch.testing.assert_close(hinted, full, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_half_dtypes_on_cpu(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    inputs = make_inputs(4, 2, 4, 64, 80, [1, 80, 31, 64], dtype, "cpu", gen)
    out = torch.empty_like(inputs["q"])
    TorchDecodeAttention()(**inputs, out=out, scale=0.125)
    assert out.dtype == dtype
    assert_close_finite(out, naive_attention(inputs, 0.125), dtype)


def test_torch_backend_idle_lane_gives_zeros() -> None:
    gen = torch.Generator().manual_seed(11)
    inputs = make_inputs(2, 2, 2, 64, 32, [0, 10], torch.float32, "cpu", gen)
    out = torch.full_like(inputs["q"], 5.0)
    TorchDecodeAttention()(**inputs, out=out, scale=0.125)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()


def test_torch_backend_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = make_inputs(2, 2, 2, 64, 16, [3, 4], torch.float32, "cpu", gen)
    inputs["seq_lens"] = inputs["seq_lens"].long()
    with pytest.raises(ValueError, match="seq_lens"):
        TorchDecodeAttention()(**inputs, out=torch.empty_like(inputs["q"]), scale=0.125)


# ----------------------------------------------------------------------------- CPU: sdpa backend


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_lane_window", [512, 1])  # batches gather whole windows / lane by lane
@pytest.mark.parametrize("half_kernel", [False, True])  # a bf16 cache in float32 copies / as it is
def test_sdpa_backend_matches_naive_loop_with_poisoned_caches(group: int, head_dim: int, dtype, per_lane_window,
                                                              half_kernel: bool, monkeypatch) -> None:
    # NaN everywhere a lane must not read: past its length, in other slots, past the hint
    monkeypatch.setattr(cpu_sdpa, "PER_LANE_WINDOW", per_lane_window)
    monkeypatch.setattr(cpu_sdpa, "HALF_PER_LANE_WINDOW", per_lane_window)
    gen = torch.Generator().manual_seed(2000 * group + head_dim)
    backend = SdpaDecodeAttention(half_kernel)
    for seq_lens in ([1], [97], [1, 50, 97], [13, 1, 64, 97, 2, 96, 40, 7]):
        inputs = make_inputs(len(seq_lens), 2, group, head_dim, 97, seq_lens, dtype, "cpu", gen)
        scale = 1.0 / math.sqrt(head_dim)
        want = naive_attention(inputs, scale)
        for hint in (None, max(seq_lens)):
            out = torch.empty_like(inputs["q"])
            backend(**inputs, out=out, scale=scale, max_len_hint=hint)
            assert_close_finite(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_batch_routes_give_the_same_bits(dtype, monkeypatch) -> None:
    """Whole windows gathered then converted, or each lane's positions converted into the window:
    the same float32 values reach the kernel."""
    gen = torch.Generator().manual_seed(77)
    inputs = make_inputs(5, 3, 3, 64, 120, [120, 1, 77, 0, 64], dtype, "cpu", gen)
    outs = []
    for per_lane_window in (10**9, 1):
        monkeypatch.setattr(cpu_sdpa, "PER_LANE_WINDOW", per_lane_window)
        out = torch.empty_like(inputs["q"])
        SdpaDecodeAttention(half_kernel=False)(**inputs, out=out, scale=0.125, max_len_hint=120)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_sdpa_half_route_keeps_float32_accuracy() -> None:
    """A bf16 cache attended in bf16 is as close to a float64 attention of the same inputs as the
    float32 copies route (both round their output to bf16 once), over long windows and a batch
    whose lanes take the per-lane calls and the gathered window."""
    gen = torch.Generator().manual_seed(5)
    for seq_lens, hint in (([1500], None), ([700, 1, 650, 0, 300], 700), ([90, 17, 64], 90)):
        inputs = make_inputs(len(seq_lens), 3, 3, 64, 1500, seq_lens, torch.bfloat16, "cpu", gen)
        want = naive_attention(inputs, 0.125)
        errs = {}
        for half in (False, True):
            out = torch.empty_like(inputs["q"])
            SdpaDecodeAttention(half)(**inputs, out=out, scale=0.125, max_len_hint=hint)
            assert torch.isfinite(out).all()
            errs[half] = float((out.double() - want).abs().max())
        scale = float(want.abs().max())
        assert errs[True] <= 1.5 * errs[False] + 1e-3 * scale, (seq_lens, errs)
        assert errs[True] <= 8e-3 * scale


@pytest.mark.parametrize("slow", ["half", "float32"])
def test_half_kernel_pays_picks_the_faster_route(slow: str, monkeypatch) -> None:
    """The probe times both routes and takes the half kernel only where it is faster by the margin:
    a kernel made 50 ms slower for one dtype loses, whatever the machine (5 ms lost once on a busy
    2-core VM)."""
    real = torch.nn.functional.scaled_dot_product_attention
    slow_dtype = torch.bfloat16 if slow == "half" else torch.float32

    def kernel(q, *args, **kwargs):
        if q.dtype == slow_dtype:
            time.sleep(0.05)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(cpu_sdpa.F, "scaled_dot_product_attention", kernel)
    pays = cpu_sdpa.half_kernel_pays.__wrapped__(torch.bfloat16, 6, 2, 64)
    assert pays is (slow == "float32")
    backend = SdpaDecodeAttention()
    monkeypatch.setattr(cpu_sdpa, "half_kernel_pays", lambda *shape: slow == "float32")
    assert backend.uses_half_kernel(torch.bfloat16, 6, 2, 64) is (slow == "float32")
    assert backend.uses_half_kernel(torch.float32, 6, 2, 64) is False


def test_cpu_attn_half_setting_reaches_the_backend() -> None:
    from fgchat.protocol.tuning import Tuning

    for want in (None, True, False):
        assert get_backend("auto", torch.device("cpu"), Tuning(cpu_attn_half=want)).half_kernel is want


def test_sdpa_backend_idle_lanes_give_zeros_and_cuda_is_refused() -> None:
    gen = torch.Generator().manual_seed(12)
    backend = SdpaDecodeAttention()
    inputs = make_inputs(3, 2, 2, 64, 32, [0, 10, 4], torch.float32, "cpu", gen)
    out = torch.full_like(inputs["q"], 5.0)
    backend(**inputs, out=out, scale=0.125, max_len_hint=10)
    assert torch.isfinite(out).all() and (out[0] == 0).all()
    assert_close_finite(out[1:], naive_attention(inputs, 0.125)[1:], torch.float32)
    one = make_inputs(1, 2, 2, 64, 32, [0], torch.float32, "cpu", gen)
    out = torch.full_like(one["q"], 5.0)
    backend(**one, out=out, scale=0.125, max_len_hint=1)
    assert (out == 0).all()
    with pytest.raises(FgchatError) as info:
        get_backend("sdpa", torch.device("cuda"))
    assert "\n" not in str(info.value) and "CPU" in str(info.value)


# ----------------------------------------------------------------------------- CPU: selection


def test_backend_names() -> None:
    assert BACKEND_NAMES == ("auto", "triton", "flash-attn", "torch", "sdpa")


def test_get_backend_torch_and_auto_on_cpu() -> None:
    assert get_backend("torch", torch.device("cpu")).name == "torch"
    assert get_backend("auto", torch.device("cpu")).name == "sdpa"


def test_get_backend_unknown_name() -> None:
    with pytest.raises(FgchatError) as info:
        get_backend("x", torch.device("cpu"))
    assert str(info.value) == "unknown attention backend 'x' (choose auto, triton, flash-attn, torch, sdpa)"


def test_get_backend_triton_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(FgchatError) as info:
        get_backend("triton", torch.device("cpu"))
    assert "\n" not in str(info.value) and "CUDA" in str(info.value)


def test_get_backend_flash_attn_missing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # sys.modules[name] = None makes `import name` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    with pytest.raises(FgchatError) as info:
        get_backend("flash-attn", torch.device("cuda"))
    assert "\n" not in str(info.value) and "flash-attn" in str(info.value)


def test_plan_num_splits_is_shape_only_and_bounded() -> None:
    # Llama-3.2-1B on an H200: 8 KV heads, 132 SMs, T = 8192.
    assert plan_num_splits(1, 8, 8192, 64, 132) == 33  # 8 * 33 = 264 = 2 * 132 programs
    assert plan_num_splits(8, 8, 8192, 64, 132) == 5
    assert plan_num_splits(1, 8, 100, 64, 132) == 2  # capped by cdiv(T, BLOCK_N)
    assert plan_num_splits(1, 1, 1 << 20, 64, 132) == 64  # capped by max_splits
    for batch in range(1, 9):
        for kv in (1, 2, 8):
            assert 1 <= plan_num_splits(batch, kv, 4096, 64, 132) <= 64


# ----------------------------------------------------------------------------- GPU: triton kernel


def _triton_backend():  # noqa: ANN202 - imported lazily: triton is absent on CPU machines
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention

    return TritonDecodeAttention(torch.device("cuda"))


def _lens_for(batch: int, max_context: int, block_n: int, gen: torch.Generator) -> list[list[int]]:
    """Length sets for one batch size: all 1, all max, and a mix with 1, block +- 1 and max."""
    special = [1, max_context, block_n + 1, block_n - 1, 2 * block_n, max_context - 1]
    mixed = [special[i] if i < len(special) else int(torch.randint(1, max_context + 1, (1,), generator=gen)) for i in range(batch)]
    perm = torch.randperm(batch, generator=gen).tolist()
    return [[1] * batch, [max_context] * batch, [mixed[i] for i in perm]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_matches_reference_grid(group: int, head_dim: int, dtype: torch.dtype) -> None:
    backend = _triton_backend()
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + (1 if dtype == torch.float16 else 0))
    max_context = 1031  # not a multiple of BLOCK_N
    num_kv_heads = 2
    scale = 1.0 / math.sqrt(head_dim)
    for batch in range(1, 9):
        for seq_lens in _lens_for(batch, max_context, backend.config(head_dim).block_n, gen):
            inputs = make_inputs(batch, num_kv_heads, group, head_dim, max_context, seq_lens, dtype, "cuda", gen)
            out = torch.empty_like(inputs["q"])
            backend(**inputs, out=out, scale=scale)
            assert_close_finite(out, reference(inputs, scale), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_fp32_and_peaked_softmax() -> None:
    """fp32 inputs (exact dot products) and large logits that stress the running max."""
    backend = _triton_backend()
    gen = torch.Generator().manual_seed(5)
    inputs = make_inputs(4, 8, 4, 128, 3000, [1, 3000, 777, 2048], torch.float32, "cuda", gen)
    inputs["q"] *= 8.0
    out = torch.empty_like(inputs["q"])
    backend(**inputs, out=out, scale=1.0 / math.sqrt(128))
    assert_close_finite(out, reference(inputs, 1.0 / math.sqrt(128)), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_idle_lane_gives_zeros() -> None:
    backend = _triton_backend()
    gen = torch.Generator().manual_seed(9)
    inputs = make_inputs(3, 2, 4, 64, 256, [0, 256, 1], torch.bfloat16, "cuda", gen)
    out = torch.full_like(inputs["q"], 3.0)
    backend(**inputs, out=out, scale=0.125)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()


def _capture(fn):  # noqa: ANN001, ANN202
    """Warm up on a side stream (compiles Triton outside capture), then capture fn in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("backend_name", ["triton", "torch"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_after_lengths_and_slots_change(backend_name: str, batch: int) -> None:
    """Capture at short lengths; change seq_lens (much longer, then shorter) and slot_ids in
    place; every replay must equal the reference on the new values (and the eager call, bitwise)."""
    backend = _triton_backend() if backend_name == "triton" else TorchDecodeAttention()
    dtype, head_dim, num_kv_heads, group, max_context = torch.bfloat16, 64, 8, 4, 4096
    scale = 1.0 / math.sqrt(head_dim)
    gen = torch.Generator().manual_seed(batch)
    # Fully random caches (no poison) so any slot/length combination is meaningful.
    static = make_inputs(batch, num_kv_heads, group, head_dim, max_context, [5] * batch, dtype, "cuda", gen, poison=False)
    out = torch.empty_like(static["q"])
    graph = _capture(lambda: backend(**static, out=out, scale=scale))

    schedule = [
        [3000 + 97 * i for i in range(batch)],  # much longer than at capture
        [max_context] * batch,
        [1 + i for i in range(batch)],  # shorter
        [int(torch.randint(1, max_context + 1, (1,), generator=gen)) for _ in range(batch)],
    ]
    for seq_lens in schedule:
        static["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        static["slot_ids"].copy_(torch.randperm(SLOTS, generator=gen)[:batch].to(torch.int32))  # stale lanes
        static["q"].copy_(torch.randn(static["q"].shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_finite(out, reference(static, scale), dtype)
        eager = torch.empty_like(out)
        backend(**static, out=eager, scale=scale)
        assert torch.equal(out, eager), "graph replay differs from an eager call with the same inputs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_stale_lane_reads_only_its_slot() -> None:
    """After capture, point lanes at slots whose contents differ; a kernel that cached slot
    addresses or read a neighbour slot at capture time would return the old slot's values."""
    backend = _triton_backend()
    dtype, head_dim, max_context, batch = torch.float16, 128, 512, 2
    gen = torch.Generator().manual_seed(42)
    static = make_inputs(batch, 2, 2, head_dim, max_context, [100, 200], dtype, "cuda", gen, poison=False)
    static["slot_ids"].copy_(torch.tensor([0, 1], dtype=torch.int32))
    for slot in range(SLOTS):  # slot s holds V == s everywhere: the output names the slot read
        static["v_cache"][slot].fill_(float(slot))
    out = torch.empty_like(static["q"])
    graph = _capture(lambda: backend(**static, out=out, scale=1.0 / math.sqrt(head_dim)))
    for slots in ([5, 6], [7, 0], [3, 3]):
        static["slot_ids"].copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        for lane, slot in enumerate(slots):
            assert torch.allclose(out[lane].float().cpu(), torch.full((4, head_dim), float(slot)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_ignores_max_len_hint_and_split_count_is_shape_only() -> None:
    backend = _triton_backend()
    gen = torch.Generator().manual_seed(1)
    inputs = make_inputs(2, 8, 4, 64, 2048, [10, 2000], torch.bfloat16, "cuda", gen)
    a, b = torch.empty_like(inputs["q"]), torch.empty_like(inputs["q"])
    backend(**inputs, out=a, scale=0.125)
    backend(**inputs, out=b, scale=0.125, max_len_hint=12)  # a wrong hint must not matter
    assert torch.equal(a, b)
    cfg = backend.config(64)
    expected = plan_num_splits(2, 8, 2048, cfg.block_n, backend.sm_count, cfg.programs_per_sm, cfg.max_splits)
    assert backend.num_splits(2, 8, 2048, 64) == expected


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 2, 2), (64, 4, 3), (128, 4, 3), (128, 8, 2)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_tuning_variants_stay_correct(block_n: int, num_warps: int, num_stages: int) -> None:
    """Every config the benchmark sweeps must be correct, so switching defaults stays safe."""
    from fgchat.engine.kernels.attention.triton_decode import KernelConfig, TritonDecodeAttention

    backend = TritonDecodeAttention(torch.device("cuda"), KernelConfig(block_n, num_warps, num_stages))
    gen = torch.Generator().manual_seed(block_n + num_stages)
    for head_dim in (64, 128):
        for seq_lens in ([1, 2000, block_n + 1, block_n - 1], [2047] * 8):
            inputs = make_inputs(len(seq_lens), 8, 4, head_dim, 2047, seq_lens, torch.bfloat16, "cuda", gen)
            out = torch.empty_like(inputs["q"])
            backend(**inputs, out=out, scale=1.0 / math.sqrt(head_dim))
            assert_close_finite(out, reference(inputs, 1.0 / math.sqrt(head_dim)), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("merge_unrolled", [True, False])
def test_fused_combine_matches_separate_kernel_and_rearms(merge_unrolled: bool) -> None:
    """The last-split merge (its live splits eight at a time, or one after another) equals the
    two-kernel path, leaves its counters at zero and stays right when replayed from a CUDA graph
    many times (counters rearm every launch)."""
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention

    fused = TritonDecodeAttention(torch.device("cuda"), fuse_combine=True, merge_unrolled=merge_unrolled)
    split = TritonDecodeAttention(torch.device("cuda"), fuse_combine=False)
    gen = torch.Generator().manual_seed(77)
    inputs = make_inputs(8, 8, 4, 64, 4096, [1, 4096, 65, 63, 128, 4095, 2000, 7], torch.bfloat16, "cuda", gen)
    want = torch.empty_like(inputs["q"])
    split(**inputs, out=want, scale=0.125)
    out = torch.zeros_like(inputs["q"])
    fused(**inputs, out=out, scale=0.125)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)
    assert fused._cnt is not None and int(fused._cnt.abs().sum()) == 0
    g = torch.cuda.CUDAGraph()
    out.zero_()
    with torch.cuda.graph(g):
        fused(**inputs, out=out, scale=0.125)
    for _ in range(50):
        out.zero_()
        g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)
    assert int(fused._cnt.abs().sum()) == 0


def _separate_then_fused_rope(hq: int, hkv: int, d: int, sep, fused, seed: int):
    """Eight lanes at positions around tile and split edges: `sep` after fused.rope_kv_write
    (want) and `fused`.decode_with_rope on a copy of the cache (got). Returns want, got and
    whether both paths left the same cache bits."""
    from fgchat.engine.kernels.fused import rope_kv_write

    t, b = 2048, 8
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    fr = torch.arange(t, device="cuda").float()[:, None] * inv[None]
    emb = torch.cat([fr, fr], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(8, t, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(8, t, hkv, d, device="cuda", generator=gen).bfloat16()
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    pos = torch.tensor([0, 1, 63, 64, 65, 1000, 2047, 7], device="cuda")
    slots = torch.tensor([3, 0, 7, 1, 2, 6, 4, 5], device="cuda")
    seq_lens, slots32 = (pos + 1).int(), slots.int()
    kc2, vc2 = kc.clone(), vc.clone()
    want = torch.empty(b, hq, d, device="cuda", dtype=torch.bfloat16)
    q = rope_kv_write(qkv, cos, sin, pos, slots, kc, vc, hq, hkv, d)
    sep(q, kc, vc, slots32, seq_lens, want, d**-0.5)
    got = torch.empty_like(want)
    fused.decode_with_rope(qkv, cos, sin, kc2, vc2, slots32, seq_lens, got, d**-0.5)
    return want, got, torch.equal(kc2, kc) and torch.equal(vc2, vc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (9, 3, 64), (12, 2, 128), (8, 8, 128)])
@pytest.mark.parametrize("fuse_combine,preload", [(True, False), (False, False), (False, True), (True, True)])
def test_rope_in_attention_same_bits_as_separate_rope(hq, hkv, d, fuse_combine, preload) -> None:
    """decode_with_rope == fused.rope_kv_write then attention: same output and cache bits, also
    when each split loads its first K/V tile before the current token's K/V exists (preload)."""
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention

    attn = TritonDecodeAttention(torch.device("cuda"), fuse_combine=fuse_combine, preload=preload,
                                 cur_from_cache=True)
    want, got, same_cache = _separate_then_fused_rope(hq, hkv, d, attn, attn, seed=hq * d)
    assert same_cache
    diff = (got.float() - want.float()).abs()
    lanes = sorted({int(i) for i in diff.amax((1, 2)).nonzero().flatten()})
    assert torch.equal(got, want), f"max |diff| {diff.max().item():.3g} in lanes {lanes}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (12, 2, 128)])
def test_current_row_from_registers_close_to_separate_rope(hq, hkv, d) -> None:
    """cur_from_cache=False: RoPE inside the preloading attention takes the current row from its
    registers; the cache gets the same bits as the separate kernel writes, the output agrees
    with the separate path to bf16 rounding."""
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention

    sep = TritonDecodeAttention(torch.device("cuda"), preload=True, cur_from_cache=True)
    regs = TritonDecodeAttention(torch.device("cuda"))  # the production default: from registers
    want, got, same_cache = _separate_then_fused_rope(hq, hkv, d, sep, regs, seed=hq + d)
    assert same_cache
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("fuse_combine,preload", [(False, True), (True, False)])
def test_recorded_launch_same_bits_as_call(rope, fuse_combine, preload) -> None:
    """An attention call recorded as a launch list (piecewise replay's use) gives the bits of the
    per-call path, step after step, while lengths, slots and inputs change in place."""
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention
    from fgchat.engine.launch_list import record

    hq, hkv, d, t, b = 16, 4, 64, 2048, 6
    attn = TritonDecodeAttention(torch.device("cuda"), fuse_combine=fuse_combine, preload=preload,
                                 pdl=True, cur_from_cache=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.arange(t, device="cuda").float()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    kc = torch.randn(8, t, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(8, t, hkv, d, device="cuda", generator=gen).bfloat16()
    kc2, vc2 = kc.clone(), vc.clone()
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    q = torch.randn(b, hq, d, device="cuda", generator=gen).bfloat16()
    seq_lens = torch.tensor([1, 2, 64, 65, 700, 1500], device="cuda", dtype=torch.int32)
    slots = torch.tensor([3, 0, 7, 1, 2, 6], device="cuda", dtype=torch.int32)
    want, got = torch.zeros(b, hq, d, device="cuda").bfloat16(), torch.zeros(b, hq, d, device="cuda").bfloat16()
    scale = d ** -0.5
    if rope:
        _, lst, why = record(lambda: attn.decode_with_rope(qkv, cos, sin, kc2, vc2, slots, seq_lens, got, scale))
    else:
        _, lst, why = record(lambda: attn(q, kc2, vc2, slots, seq_lens, got, scale))
    assert lst is not None, why
    bound = lst.replay
    for step in range(4):
        if rope:
            attn.decode_with_rope(qkv, cos, sin, kc, vc, slots, seq_lens, want, scale)
        else:
            attn(q, kc, vc, slots, seq_lens, want, scale)
        bound()
        torch.cuda.synchronize()
        assert torch.equal(got, want), step
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc), step
        seq_lens.add_(1 + 97 * step)
        slots.copy_(slots.roll(1))
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=gen))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
    assert attn._scratch, "eager calls share one scratch pair per plan"


def test_the_engine_names_the_cpu_route_it_takes(tiny_llama) -> None:
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.tuning import Tuning

    for dtype, half, want in (("bfloat16", True, "sdpa (bfloat16)"), ("bfloat16", False, "sdpa (float32 copies)"),
                              ("float32", True, "sdpa")):
        eng = Engine(EngineConfig(model=str(tiny_llama), device="cpu", mode="eager", max_context=64, dtype=dtype,
                                  tuning=Tuning(cpu_attn_half=half), self_check=False))
        assert eng.info().attention_backend == want


def test_a_head_dim_the_triton_kernels_lack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3-mini's head dim 96: `--attention triton` is one line naming the dims it takes, and
    auto on CUDA takes torch's attention instead."""
    import fgchat.engine.kernels.attention as attention

    with pytest.raises(FgchatError) as info:
        get_backend("triton", torch.device("cuda"), head_dim=96)
    msg = str(info.value)
    assert "\n" not in msg and "not 96" in msg and "64, 128, 256" in msg and "--attention torch" in msg
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    assert get_backend("auto", torch.device("cuda"), head_dim=96).name == "torch"
