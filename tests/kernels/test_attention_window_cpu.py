"""The split-K decode attention's sliding window (Gemma 3's local layers) under Triton's CPU
interpreter: with `window` > 0 a lane attends to its last `window` positions only, the start
computed in the kernel from the device-side length (so a graph stays right as lengths pass the
window), with the separate combine and the unrolled merge, against a float32 reference. The
positions outside the window hold NaN, so any read of them shows. Head dims 64 and 256."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from small_decoders import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

SCRIPT = textwrap.dedent(
    """
    import json, math, sys, torch
    import triton.runtime.interpreter as ti
    from fgchat.engine.kernels.attention import triton_decode as td

    _patch = ti._patch_lang_tensor  # as tests/kernels/test_attention_merge_cpu.py: numpy 2.4's int()

    def _patch_with_item(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    ti._patch_lang_tensor = _patch_with_item

    res = []
    for D, window, splits, fuse in json.loads(sys.argv[1]):
        B, HQ, HKV, T = 4, 4, 2, 192
        g = torch.Generator().manual_seed(D + window)
        q = torch.randn(B, HQ, D, generator=g)
        k = torch.randn(5, T, HKV, D, generator=g)
        v = torch.randn(5, T, HKV, D, generator=g)
        slots = torch.tensor([2, 0, 4, 1], dtype=torch.int32)
        lens = torch.tensor([0, 5, window + 3, T], dtype=torch.int32)
        for s, n in zip(slots.tolist(), lens.tolist()):
            k[s, : max(0, n - window)] = float("nan")
            v[s, : max(0, n - window)] = float("nan")
            k[s, n:] = float("nan")
            v[s, n:] = float("nan")
        scale = 1.0 / math.sqrt(D)
        ref = torch.zeros(B, HQ, D)
        for b in range(B):
            n, s = int(lens[b]), int(slots[b])
            lo = max(0, n - window)
            for h in range(HQ):
                if n == 0:
                    continue
                kv = h // (HQ // HKV)
                w = torch.softmax((k[s, lo:n, kv].double() @ q[b, h].double()) * scale, 0)
                ref[b, h] = (w @ v[s, lo:n, kv].double()).float()
        group = HQ // HKV
        block_s = max(2, 1 << (splits - 1).bit_length())
        part = torch.full((B, HQ, splits, D), float("nan"))
        lse = torch.empty(B, HQ, splits)
        out = torch.zeros(B, HQ, D)
        cnt = torch.zeros(B * HKV, dtype=torch.int32)
        mid = (scale * td.LOG2_E, T, group, splits, window, *q.stride()[:2], *k.stride()[:3], *v.stride()[:3],
               *part.stride()[:3], *lse.stride()[:2])
        bn = td.DEFAULT_CONFIGS[D].block_n
        td._split_kernel[(B, HKV, splits)](
            q, k, v, slots, lens, part, lse, *mid, cnt, out, *out.stride()[:2], lse, lse,
            HEAD_DIM=D, BLOCK_G=16, BLOCK_N=bn, DOT_PRECISION="ieee", FUSE_COMBINE=fuse,
            BLOCK_S=block_s, MERGE_UNROLLED=fuse, num_warps=4)
        if not fuse:
            td._combine_kernel[(B, HQ)](part, lse, out, splits, *part.stride()[:3], *lse.stride()[:2],
                                        *out.stride()[:2], HEAD_DIM=D, BLOCK_S=block_s)
        res.append(dict(err=(out - ref).abs().max().item(), finite=bool(torch.isfinite(out).all())))
    print("RESULT " + json.dumps(res))
    """
)


def test_window_reads_only_the_last_positions():
    cases = [(64, 70, 3, False), (64, 70, 3, True), (256, 40, 4, False)]
    for case, r in zip(cases, run_interpreted(SCRIPT, cases)):
        assert r["finite"], case
        assert r["err"] < 1e-4, (case, r["err"])
