"""The split-K decode attention's merge under Triton's CPU interpreter: the separate combine
kernel, the last split merging the others one split at a time, and the same merge reading the
live splits eight at a time (MERGE_UNROLLED, design.md V55), each against a float32 reference.

The backend object itself needs CUDA, so the script builds the split kernel's arguments the way
`TritonDecodeAttention._plan` / `_split_args` do. GPU coverage: tests/kernels/test_attention.py.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from small_decoders import run_interpreted

# not imported here: Triton must load after the interpreter's flag is set (tests/kernels/test_megakernel.py
# sets it at import); the script below runs in its own interpreted process
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

SCRIPT = textwrap.dedent(
    """
    import json, math, sys, torch
    import triton.runtime.interpreter as ti
    from fgchat.engine.kernels.attention import triton_decode as td

    # Triton 3.6's interpreter turns a scalar into an index with int() of a one-element array,
    # which numpy 2.4 refuses; the kernel's loops over device-side bounds need it (range(start,
    # end)). Only the interpreter's conversion changes here, not the kernel.
    _patch = ti._patch_lang_tensor

    def _patch_with_item(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    ti._patch_lang_tensor = _patch_with_item

    B, HQ, HKV, D, T = 3, 8, 2, 64, 512
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, HQ, D, generator=g)
    k = torch.randn(4, T, HKV, D, generator=g)
    v = torch.randn(4, T, HKV, D, generator=g)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    lens = torch.tensor([1, 200, 512], dtype=torch.int32)
    scale = 1.0 / math.sqrt(D)

    def reference():
        out = torch.empty(B, HQ, D)
        for b in range(B):
            n, s = int(lens[b]), int(slots[b])
            for h in range(HQ):
                kv = h // (HQ // HKV)
                w = torch.softmax((k[s, :n, kv] @ q[b, h]) * scale, 0)
                out[b, h] = w @ v[s, :n, kv]
        return out

    def attend(splits, fuse, unrolled):
        group = HQ // HKV
        block_s = max(2, 1 << (splits - 1).bit_length())
        part = torch.full((B, HQ, splits, D), float("nan"))  # empty splits never written nor read
        lse = torch.empty(B, HQ, splits)
        out = torch.zeros(B, HQ, D)
        cnt = torch.zeros(B * HKV, dtype=torch.int32)
        mid = (scale * td.LOG2_E, T, group, splits, 0, *q.stride()[:2], *k.stride()[:3], *v.stride()[:3],
               *part.stride()[:3], *lse.stride()[:2])
        td._split_kernel[(B, HKV, splits)](
            q, k, v, slots, lens, part, lse, *mid, cnt, out, *out.stride()[:2], lse, lse,
            HEAD_DIM=D, BLOCK_G=16, BLOCK_N=64, DOT_PRECISION="ieee", FUSE_COMBINE=fuse,
            BLOCK_S=block_s, MERGE_UNROLLED=unrolled, num_warps=4)
        if not fuse:
            td._combine_kernel[(B, HQ)](part, lse, out, splits, *part.stride()[:3], *lse.stride()[:2],
                                        *out.stride()[:2], HEAD_DIM=D, BLOCK_S=block_s)
        return out, int(cnt.abs().sum())

    ref = reference()
    res = []
    for splits, fuse, unrolled in json.loads(sys.argv[1]):
        out, cnt = attend(splits, fuse, unrolled)
        res.append(dict(err=(out - ref).abs().max().item(), finite=bool(torch.isfinite(out).all()), cnt=cnt))
    print("RESULT " + json.dumps(res))
    """
)


@pytest.mark.parametrize("splits", [16, 33])
def test_merges_match_the_float32_reference(splits):
    """Lengths 1, 200 and 512 leave most, some and no splits empty; 33 splits are not a multiple
    of the eight the chunked merge reads at once."""
    cases = [(splits, False, False), (splits, True, False), (splits, True, True)]
    for (_, fuse, unrolled), r in zip(cases, run_interpreted(SCRIPT, cases)):
        assert r["finite"], (fuse, unrolled)
        assert r["err"] < 1e-4, (fuse, unrolled, r["err"])
        assert r["cnt"] == 0, "the merge counters must be back at zero"
