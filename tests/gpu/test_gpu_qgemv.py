"""kernels.qgemv (and the prefill GEMM kernels.qgemm) on the GPU at the real model shapes (Llama-3.2-1B: K 2048, N 2048 / 512 / 8192;
Llama-3.1-8B: K 4096, N 14336 and K 14336, N 4096), bf16 activations with massive channels,
against the float64 composition of the same planes (tests/kernels/qweights.py); rows identical at
every batch size; a timing print per format (us per call at M = 1 and 8: this kernel beside the
one before it, tests/gpu/qgemv_before.py, and gemv.project / cuBLAS on the bf16 weight of the same
shape); and a tile-config and K-split sweep at the 1B shapes and one 8B shape."""

from __future__ import annotations

import pytest
import torch

from qweights import FORMATS, bound, compose, outlier_rows, random_qweight, terms

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16_ULP = 2.0**-7
SHAPES = [(2048, 2048), (512, 2048), (8192, 2048), (14336, 4096), (4096, 14336)]


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return outlier_rows(m, k, seed).to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(2048, 2048), (4096, 14336)])
def test_against_float64_at_real_sizes(fmt, n, k):
    from fgchat.engine.kernels import qgemv

    w = random_qweight(fmt, n, k, seed=n + k, device=DEV)
    x = _x(4, k, 1)
    w64 = compose(w)
    ref = x.double().cpu() @ w64.t()
    got = qgemv.project(x, w).double().cpu()
    mag = terms(w)
    lim = bound(x.cpu(), mag, ref, BF16_ULP)
    err = (got - ref).abs()
    print(f"\n{fmt} {n}x{k}: worst error / bound {(err / lim).max().item():.3f}")
    assert (err <= lim).all()
    parts = qgemv.project_partials(x, w, 2).double().cpu().sum(0)
    assert ((parts - ref).abs() <= bound(x.cpu(), mag, ref, 0.0)).all()
    logits = qgemv.project_logits(x, w).double().cpu()
    print(f"{fmt} {n}x{k}: float32 sums' worst error / bound "
          f"{((logits - ref).abs() / bound(x.cpu(), mag, ref, 0.0)).max().item():.3f}")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q6_K", "int4"])
def test_rows_identical_at_every_batch_size(fmt):
    from fgchat.engine.kernels import qgemv

    w = random_qweight(fmt, 8192, 2048, seed=5, device=DEV)
    x = _x(8, 2048, 2)
    full, glu = qgemv.project(x, w), qgemv.project_glu(x, w)
    for m in range(1, 8):
        xm = x[:m].contiguous()
        assert torch.equal(qgemv.project(xm, w), full[:m])
        assert torch.equal(qgemv.project_glu(xm, w), glu[:m])


def test_head_logits_and_argmax_at_vocabulary_size():
    from fgchat.engine.kernels import qgemv

    w = random_qweight("Q8_0", 128256, 2048, seed=7, device=DEV)
    x = _x(8, 2048, 3)
    logits, tokens = qgemv.project_argmax(x, w)
    assert torch.equal(tokens, logits.argmax(dim=1))
    assert torch.equal(logits, qgemv.project_logits(x, w))
    sub = qgemv.project_argmax(x[:1].contiguous(), w)
    assert torch.equal(sub[0], logits[:1]) and torch.equal(sub[1], tokens[:1])


def _us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def test_timing_print():
    """Not a pass/fail check: us per call, each format's kernel now / before (qgemv_before.py)
    beside bf16 gemv and cuBLAS, and the bytes per weight the format reads."""
    import qgemv_before

    from fgchat.engine.kernels import gemv, qgemv

    lines = []
    for n, k in SHAPES:
        dense = (torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16)
        xs = {m: _x(m, k, 4) for m in (1, 8)}
        rows = {m: [f"{n:>6}x{k:<6} M={m}: bf16 gemv {_us(lambda: gemv.project(xs[m], dense)):6.1f}"
                    f" cuBLAS {_us(lambda: torch.nn.functional.linear(xs[m], dense)):6.1f}"] for m in xs}
        for fmt in FORMATS:
            w = random_qweight(fmt, n, k, seed=1, device=DEV)
            for m, x in xs.items():
                now = _us(lambda: qgemv.project(x, w))
                before = _us(lambda: qgemv_before.project(x, w))
                rows[m].append(f"{fmt} {now:6.1f}/{before:6.1f}")
        lines += [" | ".join(r) for r in rows.values()]
    sizes = {f: random_qweight(f, 256, 4096, seed=1, device=DEV).nbytes / (256 * 4096) for f in FORMATS}
    print("\nus per call (format: now / before); bytes per weight: "
          + ", ".join(f"{f} {b:.4f}" for f, b in sizes.items()) + "\n" + "\n".join(lines))


SWEEP = [(16, 256, 4, 2), (32, 256, 4, 2), (32, 512, 4, 2), (64, 256, 4, 2), (64, 512, 4, 3),
         (32, 256, 4, 4)]
# 1B's qkv, o, gate (GLU's half) and down, and 8B's gate: (N, K, K splits to try)
SWEEP_SHAPES = [(3072, 2048, (1,)), (2048, 2048, (1, 2, 4)), (8192, 2048, (1,)), (2048, 8192, (1, 2, 4)),
                (14336, 4096, (1,))]


def test_config_sweep_print():
    """Not a pass/fail check: us per call at M = 1 / 8 for tile configs (block_n, block_k, warps,
    stages) and K splits (float32 partials, as the norm-fed projections run) at the 1B shapes and
    one 8B shape, the picked config first; where a faster one shows, pick_config / pick_split
    should take it."""
    from fgchat.engine.kernels import qgemv

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    lines = []
    for n, k, splits in SWEEP_SHAPES:
        xs = {m: _x(m, k, 4) for m in (1, 8)}
        for fmt in ("int4", "fp8", "Q4_K"):
            w = random_qweight(fmt, n, k, seed=1, device=DEV)
            picked, split = qgemv.pick_config(fmt, n, k), qgemv.pick_split(w, sm)
            cells = [f"picked {picked.block_n},{picked.block_k} split {split} "
                     + "/".join(f"{_us(lambda: qgemv.project(x, w)):.1f}" for x in xs.values())]
            for (bn, bk, warps, stages), s in ((c, s) for c in SWEEP for s in splits):
                if (k // s) % bk or bk % qgemv.UNIT[fmt] or bk > qgemv.WIDEST[fmt] * 2:
                    continue
                cfg = qgemv.QConfig(bn, bk, warps, stages)
                run = ((lambda x: qgemv.project(x, w, config=cfg)) if s == 1
                       else (lambda x: qgemv.project_partials(x, w, s, config=cfg)))
                cells.append(f"{bn},{bk},{warps},{stages}/{s} "
                             + "/".join(f"{_us(lambda: run(x)):.1f}" for x in xs.values()))
            lines.append(f"{n}x{k} {fmt}: " + " | ".join(cells))
    print("\nus per call at M = 1 / 8 (bn,bk,warps,stages/split)\n" + "\n".join(lines))


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_gemm_against_float64(fmt):
    """kernels.qgemm (qgemv.linear past 16 rows) at 1B's o shape with a bias, M = 200."""
    from fgchat.engine.kernels import qgemv

    n, k = 2048, 2048
    w = random_qweight(fmt, n, k, seed=3, device=DEV)
    x = _x(200, k, 5)
    b = (torch.randn(n, device=DEV) * 0.1).to(torch.bfloat16)
    ref = x.double().cpu() @ compose(w).t() + b.double().cpu()
    got = qgemv.linear(x, w, b).double().cpu()
    lim = bound(x.cpu(), terms(w), ref, BF16_ULP)
    err = (got - ref).abs()
    print(f"\n{fmt} gemm M=200 {n}x{k}: worst error / bound {(err / lim).max().item():.3f}")
    assert (err <= lim).all()


# 1B's qkv, o, gate | up and down (N, K)
GEMM_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
GEMM_SWEEP = [(32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 64, 256, 4, 3), (64, 64, 128, 8, 3),
              (64, 128, 128, 8, 3), (128, 64, 128, 8, 3), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4)]


def test_prefill_gemm_timing_print():
    """Not a pass/fail check: us per call at M = 64 / 512 / 2048 at the 1B shapes: the GEMM
    (kernels.qgemm, its picked config) / dequantize + cuBLAS (qgemv.linear's _dequantized path) /
    cuBLAS on a dense bf16 weight of the shape; then a GEMM config sweep (bm,bn,bk,warps,stages)
    at M = 512 / 2048. The faster of GEMM and dequantize + cuBLAS stays."""
    from fgchat.engine.kernels import qgemm, qgemv

    lines = []
    for n, k in GEMM_SHAPES:
        dense = (torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16)
        xs = {m: _x(m, k, 6) for m in (64, 512, 2048)}
        for fmt in ("int4", "fp8", "Q4_K"):
            w = random_qweight(fmt, n, k, seed=1, device=DEV)
            cfg = qgemm.pick_gemm_config(fmt, n, k)
            cells = []
            for m, x in xs.items():
                gemm = _us(lambda: qgemv.linear(x, w), reps=20)
                deq = _us(lambda: qgemv.linear(x, w, _dequantized=True), reps=20)
                bf16 = _us(lambda: torch.nn.functional.linear(x, dense), reps=20)
                cells.append(f"M={m} {gemm:7.1f}/{deq:7.1f}/{bf16:7.1f}")
            sweep = []
            for c in GEMM_SWEEP:
                g = qgemm.GConfig(*c)
                if k % g.block_k or g.block_k % qgemm.UNIT[fmt]:
                    continue
                try:
                    t = [_us(lambda: qgemm.project_rows(xs[m], w, config=g), reps=10) for m in (512, 2048)]
                except Exception as e:  # a config past the shared memory: named, not fatal
                    sweep.append(f"{','.join(map(str, c))} {type(e).__name__}")
                    continue
                sweep.append(f"{','.join(map(str, c))} {t[0]:.1f}/{t[1]:.1f}")
            lines.append(f"{n}x{k} {fmt} (picked {cfg.block_m},{cfg.block_n},{cfg.block_k},{cfg.num_warps},"
                         f"{cfg.num_stages}): " + " | ".join(cells) + "\n    sweep M=512/2048: " + " | ".join(sweep))
    print("\nus per call, gemm / dequantize + cuBLAS / bf16 cuBLAS\n" + "\n".join(lines))
