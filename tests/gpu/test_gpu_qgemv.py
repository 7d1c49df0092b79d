"""kernels.qgemv (and qgemv.linear's prefill rows) on the GPU at the real model shapes
(Llama-3.2-1B: K 2048, N 2048 / 512 / 8192; Llama-3.1-8B: K 4096, N 14336 and K 14336, N 4096;
SmolLM2-135M: K 576 / 1536), bf16 activations with massive channels, against the float64
composition of the same planes (tests/kernels/qweights.py); rows identical at every batch size.
Print tests (`-m gpu -s -k print`), each line flushed as measured, each test past BUDGET_S
measuring no more: per model (SmolLM2's Q4_1 / Q8_0 head; the 1B preset's int4 / fp8 / Q4_K) each
role as the engine launches it, the picked config beside the old picker's and the bf16 kernel's
(CUDA graphs; one weight in L2 and copies read from HBM); a row-tile / K-split / tile sweep per
model; the prefill GEMM (kernels.qgemm) against dequantize + cuBLAS and bf16 cuBLAS."""

from __future__ import annotations

import pytest
import torch

from qweights import FORMATS, bound, compose, outlier_rows, random_qweight, terms

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16_ULP = 2.0**-7


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


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "fp8"])
def test_smollm2_shapes_as_picked_against_float64(fmt):
    """SmolLM2-135M's qkv (plain), gate | up (GLU) and down (split as pick_split splits it) at the
    picked configs (K 576: tiles of no power of two), M = 8."""
    from fgchat.engine.kernels import qgemv

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k, how in ((960, 576, "plain"), (3072, 576, "glu"), (576, 1536, "split")):
        w = random_qweight(fmt, n, k, seed=n + k, device=DEV)
        x = _x(8, k, 1)
        ref = x.double().cpu() @ compose(w).t()
        lim = bound(x.cpu(), terms(w), ref, 0.0)
        if how == "glu":
            gu = qgemv.project(x, w).float()
            g, u = gu[:, :n // 2], gu[:, n // 2:]
            want = ((g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float() * u).to(torch.bfloat16)
            assert torch.equal(qgemv.project_glu(x, w), want)
            continue
        split = qgemv.pick_split(w, sm) if how == "split" else 1
        got = (qgemv.project_partials(x, w, split).sum(0) if split > 1 else qgemv.project_logits(x, w)).double().cpu()
        cfg = qgemv.pick_config(fmt, n, k, split, sm)
        print(f"\n{fmt} {n}x{k} {how}: {cfg.block_n},{cfg.block_k} x{split}, worst error / bound "
              f"{((got - ref).abs() / lim).max().item():.3f}")
        assert ((got - ref).abs() <= (split + 1) * lim).all()


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


# --- timing prints: each line flushed as measured; each test stops measuring past BUDGET_S ---
BUDGET_S = 80.0  # a print test's measuring time (Triton compiles ~1-2 s each on an H100)
COLD_BYTES = 96 * 2**20  # copies of a weight past this size: beyond the H100's / H200's 50 MB L2
# (role, N, K, format) per model: N the outputs (gate: the GLU's half, its weight 2N rows);
# SmolLM2-135M's Q4_1 file (head Q8_0), the 1B preset's --quantize formats and llama.cpp's Q4_K
MODELS = {
    "smollm2": [("qkv", 960, 576, "Q4_1"), ("o", 576, 576, "Q4_1"), ("gate", 1536, 576, "Q4_1"),
                ("down", 576, 1536, "Q4_1"), ("head", 49152, 576, "Q8_0")],
    "1b": [(role, n, k, fmt) for fmt in ("int4", "fp8", "Q4_K") for role, n, k in
           (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate", 8192, 2048), ("down", 2048, 8192))],
}
NORM_FED = ("o", "down")  # their partial sums go to the norm: split along K


class _Budget:
    def __init__(self) -> None:
        import time

        self.clock = time.monotonic
        self.end = self.clock() + BUDGET_S
        self.told = False

    def spent(self) -> bool:
        if self.clock() < self.end:
            return False
        if not self.told:
            print(f"  (past {BUDGET_S:.0f} s: the rest not measured)", flush=True)
            self.told = True
        return True


def _copies(w, nbytes: int) -> list:
    """w and copies of it, together past COLD_BYTES (a call cycling over them reads from HBM)."""
    from fgchat.engine.quant.qweight import QuantWeight

    count = min(512, max(1, -(-COLD_BYTES // nbytes)))
    if isinstance(w, torch.Tensor):
        return [w] + [w.clone() for _ in range(count - 1)]
    return [w] + [QuantWeight(w.fmt, w.shape, {n: p.clone() for n, p in w.planes.items()}, w.dtype)
                  for _ in range(count - 1)]


def _graph_us(run, weights: list, reps: int) -> float:
    """us per call of run(w) over `weights` in turn, replayed from one CUDA graph (no host launch
    cost in the number: the step runs as a graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights[:2]:
            run(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            run(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (3 * reps)


def _times(run, cold: list, xs: dict) -> str:
    """'M=1 hot/cold M=8 hot/cold' in us per call: hot one weight (in L2 after the first call),
    cold the weight's copies in turn."""
    cells = []
    for m, x in xs.items():
        hot = _graph_us(lambda w: run(x, w), cold[:1], 24)
        far = _graph_us(lambda w: run(x, w), cold, max(24, len(cold)))
        cells.append(f"M={m} {hot:5.1f}/{far:5.1f}")
    return " ".join(cells)


def _old_pick(fmt: str, n: int, k: int, split: int = 1):
    """qgemv's picker at bb5c43a: rows by size class, power-of-two K tiles up to WIDEST."""
    from fgchat.engine.kernels import qgemv
    from fgchat.engine.kernels.qdot import tile_width

    rows = 64 if n >= 32768 else 32 if n * k > 2048 * 2048 else 16
    return qgemv.QConfig(block_n=rows, block_k=tile_width(fmt, k // split, qgemv.WIDEST[fmt]))


def _old_split(fmt: str, n: int, k: int, sm: int) -> int:
    """qgemv.pick_split at bb5c43a: the smallest split reaching two programs per SM at the size
    class's rows, slices of at least 512 columns with a power-of-two tile."""
    from fgchat.engine.intmath import cdiv
    from fgchat.engine.kernels import qgemv
    from fgchat.engine.kernels.qdot import tile_width

    programs, split = cdiv(n, _old_pick(fmt, n, k).block_n), 1
    for s in (2, 3, 4, 6, 8):
        if programs * split >= 2 * sm:
            break
        try:
            tile_width(fmt, k // s, qgemv.WIDEST[fmt])
        except ValueError:
            continue
        if k % s == 0 and k // s >= 512:
            split = s
    return split


def _qrun(role: str, cfg, split: int):
    """The role's quantized launch as the engine makes it, with config cfg and K split."""
    from fgchat.engine.kernels import qgemv

    if role == "gate":
        return lambda x, w: qgemv.project_glu(x, w, config=cfg)
    if role == "head":
        return lambda x, w: qgemv.project_argmax(x, w, config=cfg)
    if split > 1:
        return lambda x, w: qgemv.project_partials(x, w, split, config=cfg)
    return lambda x, w: qgemv.project(x, w, config=cfg)


def _dense_route(role: str, n: int, k: int, sm: int):
    """(run, config, split) of the bf16 kernel on the shape, as fused_step routes a bf16 weight
    (the head: the exact kernel, not head_pick's int8 pick)."""
    from fgchat.engine.kernels import gemv

    if role == "gate":
        cfg = gemv.pick_config(n, k, glu=True)
        return (lambda x, w: gemv.project_glu(x, w, cfg)), cfg, 1
    if role == "head":
        cfg = gemv.pick_config(n, k)
        return (lambda x, w: gemv.project_argmax(x, w, cfg)), cfg, 1
    split = 1
    if role in NORM_FED and n * k >= gemv.MAX_WEIGHT_ELEMENTS and gemv.wide_k_split(n, k, sm):
        cfg, split = gemv.WIDE_K_TILE, gemv.wide_k_split(n, k, sm)
    else:
        cfg = gemv.pick_config(n, k)
        split = gemv.pick_split(n, k, sm, cfg) if role in NORM_FED else 1
    if split > 1:
        return (lambda x, w: gemv.project_partials(x, w, split, cfg)), cfg, split
    return (lambda x, w: gemv.project(x, w, cfg)), cfg, 1


def _label(cfg, split: int, n: int) -> str:
    programs = -(-n // cfg.block_n) * split
    return f"{cfg.block_n},{cfg.block_k},{cfg.num_warps},{cfg.num_stages} x{split} ({programs})"


@pytest.mark.parametrize("model", list(MODELS))
def test_timing_print(model):
    """Not a pass/fail check: per role as the engine launches it, us per call (M=1 / 8, hot: one
    weight in L2 / cold: copies read from HBM) of the picked config (new), the old picker's
    (bb5c43a) where it differs, and the bf16 kernel on a bf16 weight of the shape; (programs)."""
    from fgchat.engine.kernels import qgemv

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    budget = _Budget()
    print(f"\n{model}: us per call, M=1 / 8 hot/cold; bn,bk,warps,stages xsplit (programs); {sm} SMs", flush=True)
    dense_done = set()
    for role, n, k, fmt in MODELS[model]:
        rows = 2 * n if role == "gate" else n
        xs = {m: _x(m, k, 4) for m in (1, 8)}
        w = random_qweight(fmt, rows, k, seed=1, device=DEV)
        cold = _copies(w, w.nbytes)
        split = qgemv.pick_split(w, sm) if role in NORM_FED else 1
        new = qgemv.pick_config(fmt, n, k, split, sm)
        old_split = _old_split(fmt, n, k, sm) if role in NORM_FED else 1
        old = _old_pick(fmt, n, k, old_split)
        line = f"  {role:4} {rows}x{k} {fmt}: new {_label(new, split, n)} {_times(_qrun(role, new, split), cold, xs)}"
        if (old, old_split) != (new, split) and not budget.spent():
            line += f" | old {_label(old, old_split, n)} {_times(_qrun(role, old, old_split), cold, xs)}"
        if (role, n, k) not in dense_done and not budget.spent():
            dense_done.add((role, n, k))
            d = (torch.randn(rows, k, device=DEV) * 0.02).to(torch.bfloat16)
            run, cfg, dsplit = _dense_route(role, n, k, sm)
            line += f" | bf16 {_label(cfg, dsplit, n)} {_times(run, _copies(d, d.nbytes), xs)}"
        print(line, flush=True)
        del cold, w
        if budget.spent():
            return
    sizes = {f: random_qweight(f, 256, 4096, seed=1).nbytes / (256 * 4096) for f in FORMATS}
    print("  bytes per weight: " + ", ".join(f"{f} {b:.4f}" for f, b in sizes.items()), flush=True)


def _candidates(role: str, fmt: str, n: int, k: int, picked: int) -> list[tuple[int, int, int]]:
    """(block_n, split, tile) to sweep: row tiles 8..32 (the head 32..128; norm-fed 8, 16) at the
    splits within a factor 2 of the picked one that slice K into whole units of >= MIN_SLICE, the
    widest tile of the slice, and unsplit, the power-of-two tile too where it is narrower."""
    from fgchat.engine.kernels import qgemv
    from fgchat.engine.kernels.qdot import tile_width

    splits = [s for s in qgemv.SPLITS if k % s == 0 and (k // s) % qgemv.UNIT[fmt] == 0 and picked <= 2 * s
              and s <= 2 * picked and (s == 1 or k // s >= qgemv.MIN_SLICE)] if role in NORM_FED else [1]
    rows = (32, 64, 128) if role == "head" else (8, 16) if role in NORM_FED else (8, 16, 32)
    out = []
    for s in splits:
        wide = qgemv.tile_k(fmt, k // s)
        narrow = tile_width(fmt, k // s, qgemv.WIDEST[fmt])
        for bn in rows:
            out += [(bn, s, wide)] + ([(bn, s, narrow)] if narrow != wide and s == 1 else [])
    return out


@pytest.mark.parametrize("model,formats", [("smollm2", ("Q4_1", "Q8_0")), ("1b", ("int4",)), ("1b", ("fp8",))])
def test_config_sweep_print(model, formats):
    """Not a pass/fail check: us per call at M = 1 / 8 (cold: weights from HBM) over row tiles,
    K splits and tile widths per role (one warp below 32 rows, as picked), the new pick and the old
    first, then 1, 2 and 4 warps and 3 and 4 stages at the new pick; where a faster one shows, pick_config /
    pick_split should take it."""
    from fgchat.engine.kernels import qgemv

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    budget = _Budget()
    print(f"\n{model} {'/'.join(formats)} sweep: us per call M=1 / 8 cold; bn,bk,warps,stages xsplit "
          f"(programs); {sm} SMs", flush=True)
    for role, n, k, fmt in MODELS[model]:
        if fmt not in formats:
            continue
        rows = 2 * n if role == "gate" else n
        xs = {m: _x(m, k, 4) for m in (1, 8)}
        w = random_qweight(fmt, rows, k, seed=1, device=DEV)
        cold = _copies(w, w.nbytes)
        split = qgemv.pick_split(w, sm) if role in NORM_FED else 1
        new = qgemv.pick_config(fmt, n, k, split, sm)
        old_split = _old_split(fmt, n, k, sm) if role in NORM_FED else 1
        tried = [(new, split), (_old_pick(fmt, n, k, old_split), old_split)]
        tried += [(qgemv.QConfig(bn, bk, qgemv.WIDE_ROWS_WARPS if bn >= 32 else 1), s)
                  for bn, s, bk in _candidates(role, fmt, n, k, split)]
        tried += [(qgemv.QConfig(new.block_n, new.block_k, warps), split) for warps in (1, 2, 4)]
        # deeper pipelines: more of each program's tiles in flight (one warp holds few bytes)
        tried += [(qgemv.QConfig(new.block_n, new.block_k, new.num_warps, stages), split) for stages in (3, 4)]
        cells, seen = [], set()
        for cfg, s in tried:
            if (cfg, s) in seen:
                continue
            seen.add((cfg, s))
            if budget.spent():
                break
            run = _qrun(role, cfg, s)
            us = [_graph_us(lambda w: run(x, w), cold, max(24, len(cold))) for x in xs.values()]
            cells.append(f"{_label(cfg, s, n)} {us[0]:.1f}/{us[1]:.1f}")
        print(f"  {role:4} {rows}x{k} {fmt}: " + " | ".join(cells), flush=True)
        del cold, w
        if budget.spent():
            return


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_gemm_against_float64(fmt):
    """qgemv.linear past 16 rows (qgemm's GEMM, weights rounded to bf16) at 1B's o shape with a
    bias, M = 200."""
    from fgchat.engine.kernels import qgemv

    n, k = 2048, 2048
    w = random_qweight(fmt, n, k, seed=3, device=DEV)
    x = _x(200, k, 5)
    b = (torch.randn(n, device=DEV) * 0.1).to(torch.bfloat16)
    ref = x.double().cpu() @ compose(w).t() + b.double().cpu()
    got = qgemv.linear(x, w, b).double().cpu()
    # each weight rounded once to bf16 (half an ulp of it) on top of the exact kernels' bound
    lim = bound(x.cpu(), terms(w), ref, BF16_ULP) + BF16_ULP / 2 * (x.double().cpu().abs() @ compose(w).abs().t())
    err = (got - ref).abs()
    print(f"\n{fmt} prefill M=200 {n}x{k}: worst error / bound {(err / lim).max().item():.3f}")
    assert (err <= lim).all()


# 1B's qkv, o, gate | up and down (N, K)
GEMM_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]


def _us(fn, reps: int = 20) -> float:
    """us per eager call (prefill's GEMMs: their host launch cost is small beside them)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def test_prefill_timing_print():
    """Not a pass/fail check: us per call at M = 64 / 512 / 2048 / 4096 at the 1B shapes:
    qgemv.linear (qgemm's GEMM on the planes) / the old path (dequantize + cuBLAS) / cuBLAS on a
    dense bf16 weight of the shape: the quantized TTFT's excess over bf16."""
    from fgchat.engine.kernels import qgemv, qtiles

    budget = _Budget()
    print("\nus per call, qgemm / dequantize + cuBLAS / bf16 cuBLAS", flush=True)
    for n, k in GEMM_SHAPES:
        dense = (torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16)
        xs = {m: _x(m, k, 6) for m in (64, 512, 2048, 4096)}
        for fmt in ("int4", "fp8", "Q4_K", "Q6_K", "Q8_0"):
            w = random_qweight(fmt, n, k, seed=1, device=DEV)
            cells = [f"M={m} {_us(lambda: qgemv.linear(x, w)):7.1f}/"
                     f"{_us(lambda: torch.nn.functional.linear(x, qtiles.dequantize(w, x.dtype))):7.1f}/"
                     f"{_us(lambda: torch.nn.functional.linear(x, dense)):7.1f}" for m, x in xs.items()]
            print(f"  {n}x{k} {fmt}: " + " | ".join(cells), flush=True)
            if budget.spent():
                return
