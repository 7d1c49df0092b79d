"""A row's decode attention does not depend on the rows beside it, under Triton's CPU interpreter
(bf16, rounding to nearest-even as the GPU does: tests/interpreter_rounding.py).

The split kernel partitions each lane's positions into chunks by the lane's length and a count
fixed per (Hkv, T, D) and SM count; the grid's program count (the batch's) only decides which
program runs a chunk. So a lane alone, among 8 lanes and among 40 rows (a verification step at
batch 8, block 5) gives the same bits; RoPE inside the kernel gives the bits of the separate
RoPE + cache-write kernel then attention; the rows of one slot's block, their K/V written
first, give the bits of one-token steps run one after another. Broken variants fail the same
comparisons: the partition taken from the row count (the old plan), and q rounded once instead
of at fused.rope_kv_write's rounding points. GPU coverage: tests/gpu/test_gpu_speculate.py.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from small_decoders import run_interpreted

# not imported here: Triton must load after the interpreter's flag is set; the script runs in its
# own interpreted process (as tests/kernels/test_attention_merge_cpu.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, "tests")
    import triton.runtime.interpreter as ti
    import interpreter_rounding
    assert interpreter_rounding.install()
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention
    from fgchat.engine.kernels.fused import rope_kv_write

    _patch = ti._patch_lang_tensor  # as tests/kernels/test_attention_merge_cpu.py: numpy 2.4's int()

    def _patch_with_item(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    ti._patch_lang_tensor = _patch_with_item

    HQ, HKV, D, T, SLOTS, SMS = 8, 2, 64, 512, 48, 16
    BF = torch.bfloat16
    SCALE = D ** -0.5
    g = torch.Generator().manual_seed(7)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.arange(T).float()[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    COS, SIN = emb.cos().to(BF), emb.sin().to(BF)
    K0 = torch.randn(SLOTS, T, HKV, D, generator=g).to(BF)
    V0 = torch.randn(SLOTS, T, HKV, D, generator=g).to(BF)
    WIDTH = (HQ + 2 * HKV) * D
    # eight lanes at tile and chunk edges (partition 8 at T 512: chunks of 64 up to 512 positions)
    LENS = [1, 2, 64, 65, 129, 300, 511, 512]
    LANE_SLOTS = [3, 0, 7, 1, 2, 6, 4, 5]
    ALONE = [0, 3, 5, 7]  # lanes run alone too: one chunk, two, and past two chunks of 64 (the last two)
    QKV = torch.randn(8, WIDTH, generator=g).to(BF)
    FILL_QKV = torch.randn(32, WIDTH, generator=g).to(BF)
    FILL_LENS = torch.randint(1, T + 1, (32,), generator=g).tolist()
    FILL_SLOTS = list(range(8, 40))  # a slot of its own per row: no row reads another's write

    class RowsPartition(TritonDecodeAttention):
        # the broken variant: the partition follows the row count (the plan before issue 55's fix)
        rows = 1

        def partition(self, num_kv_heads, max_context, head_dim):
            return self.num_splits(self.rows, num_kv_heads, max_context, head_dim)

    def backend(cls=TritonDecodeAttention):
        return cls(torch.device("cpu"), sm_count=SMS, pdl=True)

    def rows_of(lanes, filled):
        qkv = QKV[lanes]
        lens, slots = [LENS[i] for i in lanes], [LANE_SLOTS[i] for i in lanes]
        if filled:
            qkv = torch.cat([qkv, FILL_QKV])
            lens, slots = lens + FILL_LENS, slots + FILL_SLOTS
        return qkv.contiguous(), torch.tensor(lens, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)

    def with_rope(att, lanes, filled=False):
        qkv, lens, slots = rows_of(lanes, filled)
        k, v = K0.clone(), V0.clone()
        out = torch.zeros(len(lens), HQ, D, dtype=BF)
        att.rows = len(lens)
        att.decode_with_rope(qkv, COS, SIN, k, v, slots, lens, out, SCALE)
        return out[: len(lanes)], k, v

    def separate(att, lanes, q_once=False):
        qkv, lens, slots = rows_of(lanes, False)
        k, v = K0.clone(), V0.clone()
        pos = (lens - 1).long()
        q = rope_kv_write(qkv, COS, SIN, pos, slots.long(), k, v, HQ, HKV, D)
        if q_once:  # the broken variant: x * cos + rotate_half(x) * sin in float32, rounded once
            x = qkv[:, : HQ * D].view(-1, HQ, D).float()
            rot = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
            q = (x * COS[pos][:, None].float() + rot * SIN[pos][:, None].float()).to(BF)
        out = torch.zeros(len(lanes), HQ, D, dtype=BF)
        att.rows = len(lanes)
        att(q.contiguous(), k, v, slots, lens, out, SCALE)
        return out, k, v

    def block_rows(att):
        # one slot, rows at positions 299..303: the stages write every row's K/V, then the call
        n, slot, block = 300, 9, 5
        qkv = torch.cat([QKV[:1], FILL_QKV[:block - 1]]).contiguous()
        lens = torch.tensor([n + j for j in range(block)], dtype=torch.int32)
        slots = torch.full((block,), slot, dtype=torch.int32)
        k, v = K0.clone(), V0.clone()
        rope_kv_write(qkv, COS, SIN, (lens - 1).long(), slots.long(), k, v, HQ, HKV, D)
        got = torch.zeros(block, HQ, D, dtype=BF)
        att.for_blocks().decode_with_rope(qkv, COS, SIN, k, v, slots, lens, got, SCALE)
        k1, v1 = K0.clone(), V0.clone()
        want = torch.zeros(block, HQ, D, dtype=BF)
        for j in range(block):  # one-token steps, one after another
            att.decode_with_rope(qkv[j : j + 1], COS, SIN, k1, v1, slots[j : j + 1], lens[j : j + 1],
                                 want[j : j + 1], SCALE)
        return torch.equal(got, want) and torch.equal(k, k1) and torch.equal(v, v1)

    res = {}
    for case in json.loads(sys.argv[1]):
        if case == "rows":
            att = backend()
            res["programs"] = [att.num_splits(r, HKV, T, D) for r in (1, 8, 40)]
            res["partition"] = att.partition(HKV, T, D)
            eight, k8, v8 = with_rope(att, list(range(8)))
            forty, k40, v40 = with_rope(att, list(range(8)), filled=True)
            res["alone_vs_8"] = [bool(torch.equal(with_rope(att, [i])[0][0], eight[i])) for i in ALONE]
            res["forty_vs_8"] = bool(torch.equal(forty, eight))
            res["cache_40"] = bool(torch.equal(k40[:8], k8[:8]) and torch.equal(v40[:8], v8[:8]))
            res["finite"] = bool(torch.isfinite(eight.float()).all())
            old = backend(RowsPartition)
            eight_old = with_rope(old, list(range(8)))[0]
            res["old_alone_vs_8"] = [bool(torch.equal(with_rope(old, [i])[0][0], eight_old[i])) for i in ALONE[2:]]
        elif case == "rope":
            att = backend()
            got, kg, vg = with_rope(att, ALONE)
            want, kw, vw = separate(att, ALONE)
            res["rope_same"] = bool(torch.equal(got, want))
            res["rope_cache_same"] = bool(torch.equal(kg, kw) and torch.equal(vg, vw))
            res["q_once_same"] = bool(torch.equal(separate(att, ALONE, q_once=True)[0], got))
        elif case == "block":
            res["block_same"] = bool(block_rows(backend()))
    print("RESULT " + json.dumps([res]))
    """
)


def test_a_rows_attention_is_the_same_alone_among_8_and_among_40_rows():
    r = run_interpreted(SCRIPT, ["rows"])[0]
    assert r["programs"] == [8, 2, 1] and r["partition"] == 8  # three grids, one partition
    assert r["finite"]
    assert all(r["alone_vs_8"]), r["alone_vs_8"]
    assert r["forty_vs_8"] and r["cache_40"]
    # the partition taken from the row count changes the bits of the lanes past 2 chunks of 64
    assert not all(r["old_alone_vs_8"]), "the broken variant must differ"


def test_rope_in_attention_is_separate_rope_then_attention_bit_for_bit():
    r = run_interpreted(SCRIPT, ["rope", "block"])[0]
    assert r["rope_same"] and r["rope_cache_same"]
    assert not r["q_once_same"], "q rounded once must not pass as fused.rope_kv_write's rounding"
    assert r["block_same"]


def test_the_blocks_twin_launches_the_same_kernel_without_dependent_launch():
    """for_blocks: the same split kernel constants (PRELOAD and USE_PDL included) and grid as the
    plain call, launched only after the preceding kernel ends (its preloaded tile then sees the
    rows the stages wrote); without PDL it is the backend itself."""
    from fgchat.engine.kernels.attention.triton_decode import TritonDecodeAttention

    att = TritonDecodeAttention(torch.device("cpu"), sm_count=132)
    assert att.for_blocks() is att  # no PDL on CPU: nothing is read before a wait
    att.pdl = att.pdl_entry = True
    twin = att.for_blocks()
    assert twin is not att and att.for_blocks() is twin and twin.preload
    hq, hkv, d, t, rows = 32, 8, 64, 2048, 40
    qkv = torch.zeros(rows, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    cos = torch.zeros(t, d, dtype=torch.bfloat16)
    k = torch.zeros(8, t, hkv, d, dtype=torch.bfloat16)
    lens, slots = torch.ones(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    out = torch.zeros(rows, hq, d, dtype=torch.bfloat16)
    plain = att._rope_plan(qkv, cos, cos, k, k, slots, lens, out, 0.125)
    block = twin._rope_plan(qkv, cos, cos, k, k, slots, lens, out, 0.125)
    assert plain.split_kw["launch_pdl"] and not block.split_kw["launch_pdl"]
    assert {**block.split_kw, "launch_pdl": True} == plain.split_kw
    assert block.split_grid == plain.split_grid and block.split_mid == plain.split_mid
    assert plain.split_kw["PRELOAD"] and plain.split_kw["USE_PDL"]
    # partition: one lane's split count at every batch size; programs: the batch's
    assert plain.part_shape[2] == att.partition(hkv, t, d) == att.num_splits(1, hkv, t, d) == 32
    assert plain.split_grid[2] == att.num_splits(rows, hkv, t, d) == 1
    att.pdl_entry = False  # a library kernel before attention: plain launches everywhere
    assert att.for_blocks() is att
