"""Compiles every Triton kernel of the decode step for sm_90 (Hopper) without a GPU, at the shapes
and settings the step launches them with (Llama-3.2-1B, Llama-3.1-8B and SmolLM2-135M tiles, with
and without programmatic dependent launch), so a kernel edit made on a CPU-only machine is checked
by the real compiler, not only by Triton's interpreter. Per kernel variant it prints shared memory,
the PTX register count, the grid-dependency instructions, and the global loads issued before the
PDL wait (the weights' prefetch). Needs triton, no CUDA.

With --quant, the quantized projection (kernels.qgemv) per weight format instead: the SASS
instructions of its K loop per weight, a by-design check of its arithmetic against the memory
bound (an H100 issues about 0.93e12 warp instructions a second; at 3.35 TB/s a 4-bit weight
stream leaves about 0.14 warp instructions per weight, an 8-bit one 0.28).

    python tools/compile_check.py
    python tools/compile_check.py --quant [--shape 14336x4096] [FMT ...]
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fgchat.engine.kernels import fused, gemv, head_pick, l2_prefetch, qgemv
from fgchat.engine.kernels import megakernel as mk
from fgchat.engine.kernels.attention import triton_decode as td
from fgchat.engine.kernels.qtiles import PLANES

TARGET = GPUTarget("cuda", 90, 32)
PLANE_TYPES = {"qs": "*u8", "ql": "*u8", "qh": "*u8", "sc": "*u8", "mn": "*u8", "d": "*fp16", "dmin": "*fp16",
               "m": "*fp16", "w": "*fp8e4nv", "scale": "*fp32"}
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def build(fn, signature: dict, constexprs: dict, **options) -> None:
    sig = dict(signature)
    # constexprs left out take their defaults, as a launch gives them (ASTSource would pass None)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in sig
                     and p.default is not inspect.Parameter.empty}, **constexprs}
    for name in constexprs:
        sig[name] = "constexpr"
    # pointers 16-byte aligned, as the launches specialise them
    # and integer strides that are multiples of 16 at every launch (Triton specialises those too)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or n.startswith("stride_") and t == "i64"}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    k = triton.compile(src, target=TARGET, options=options)
    asm = k.asm.get("ptx", "")
    regs = re.findall(r"\.reg \.b32\s+%r<(\d+)>", asm)
    print(f"{fn.__name__:22} pdl={constexprs.get('USE_PDL')!s:5} smem={k.metadata.shared:6} "
          f"ptx b32 regs={regs[0] if regs else '?':>4} griddepcontrol={asm.count('griddepcontrol')} "
          f"loads before the wait={_loads_before_wait(asm)}")


def _loads_before_wait(ptx: str) -> str:
    """Global loads (kind: count) issued before griddepcontrol.wait, the weights' prefetch."""
    head = ptx.split("griddepcontrol.wait")[0] if "griddepcontrol.wait" in ptx else ""
    kinds = re.findall(r"\b(ld\.global[\w.]*|cp\.async[\w.]*)", head)
    return ",".join(f"{k}:{kinds.count(k)}" for k in sorted(set(kinds))) or "-"


def main() -> None:
    for pdl in (False, True):
        proj = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "M": "i32", "stride_y": "i32",
                "stride_split": "i32", "pmax_ptr": "*fp32", "pidx_ptr": "*i32", "stride_p": "i32",
                "temp_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64"}
        for sample in (False, True):  # the LM head's greedy pick, then its sampled pick
            build(gemv._proj_kernel, proj,
                  dict(N=128256, K=2048, EVEN_K=True, EVEN_N=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                       DOT_PRECISION="tf32", USE_PDL=pdl, SPLIT_K=1, ARGMAX=True, SAMPLE=sample),
                  num_warps=4, num_stages=4, launch_pdl=pdl)
        # gate/up + SiLU: 1B's tiles, then 8B's one-wave tile
        for n, k, tile in ((8192, 2048, "16,512,4,4"), (8192, 2048, "64,128,4,4,1"), (8192, 2048, "128,64,4,4,1"),
                           (14336, 4096, "128,128,8,3,1")):
            c = gemv.ProjConfig.parse(tile)
            build(gemv._proj_kernel, dict(proj, y_ptr="*bf16"),
                  dict(N=n, K=k, EVEN_K=True, EVEN_N=True, BLOCK_M=16, BLOCK_N=c.block_n,
                       BLOCK_K=c.block_k, DOT_PRECISION="tf32", USE_PDL=pdl, SPLIT_K=1, GLU=True, SWAP=c.swap),
                  num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=pdl)
        # 1B's and 8B's o and down on the wide-K tile, one then two weight tiles before the wait
        for n, k, split in ((2048, 2048, 4), (2048, 8192, 4), (4096, 4096, 2), (4096, 14336, 2)):
            c = gemv.WIDE_K_TILE
            for pre in (1, 2):
                build(gemv._proj_kernel, proj,
                      dict(N=n, K=k, EVEN_K=True, EVEN_N=True, BLOCK_M=16, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                           DOT_PRECISION="tf32", USE_PDL=pdl, SPLIT_K=split, SWAP=c.swap, PRE_TILES=pre),
                      num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=pdl)
        # the int8 LM-head pick: pass 1 at its default and swapped tiles, pass 2 on 1B's head
        # (whole K tiles) and SmolLM2's (a K tail); greedy and sampled
        pick_sig = {"x_ptr": "*bf16", "logits_ptr": "*fp32", "plo_ptr": "*fp32", "phi_ptr": "*fp32", "M": "i32",
                    "temp_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64"}
        for sample in (False, True):
            for bk, warps, stages, swap in ((256, 4, 4, False), (256, 4, 4, True)):
                build(head_pick._approx_kernel, dict(pick_sig, q_ptr="*i8", scale_ptr="*fp32", slack_ptr="*fp32"),
                      dict(P=2004, N=128256, K=2048, BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, USE_PDL=pdl,
                           SAMPLE=sample, LIBDEVICE=True, SWAP=swap),
                      num_warps=warps, num_stages=stages, launch_pdl=pdl)
            for n, k in ((128256, 2048), (49152, 576)):
                tiles = -(-n // 64)
                build(head_pick._rescore_kernel, dict(pick_sig, w_ptr="*bf16", cmax_ptr="*fp32", cidx_ptr="*i32"),
                      dict(P=tiles, CHUNKS=-(-tiles // head_pick.TILES_PER_CHUNK), N=n, K=k, EVEN_K=k % 128 == 0,
                           BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, TILES=head_pick.TILES_PER_CHUNK,
                           P_BLOCK=head_pick.P_BLOCK, SWAP=False, DOT_PRECISION="tf32", USE_PDL=pdl,
                           SAMPLE=sample, LIBDEVICE=True),
                      num_warps=4, num_stages=4, launch_pdl=pdl)
        build(gemv.argmax_finish_kernel, {"pmax_ptr": "*fp32", "pidx_ptr": "*i32", "out_ptr": "*i64", "P": "i32",
                                           "stride_p": "i32"}, dict(BLOCK_P=2048, USE_PDL=pdl), num_warps=4,
              launch_pdl=pdl)
        build(gemv._proj_kernel, proj,
              dict(N=2048, K=8192, EVEN_K=True, EVEN_N=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512,
                   DOT_PRECISION="tf32", USE_PDL=pdl, SPLIT_K=4), num_warps=4, num_stages=4, launch_pdl=pdl)
        build(gemv._proj_kernel, dict(proj, y_ptr="*bf16"),
              dict(N=960, K=576, EVEN_K=False, EVEN_N=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128,
                   DOT_PRECISION="tf32", USE_PDL=pdl, SPLIT_K=1), num_warps=4, num_stages=4, launch_pdl=pdl)
        build(fused._add_rms_norm_kernel, {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "h_out_ptr": "*bf16",
                                           "y_ptr": "*bf16", "n_cols": "i32", "eps": "fp32", "stride_part": "i32"},
              dict(HAS_DELTA=True, BLOCK=2048, USE_PDL=pdl, PARTS=4), num_warps=4, launch_pdl=pdl)
        build(fused._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32"},
              dict(BLOCK=1024, USE_PDL=pdl), num_warps=4, launch_pdl=pdl)
        rope = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
                "slot_ptr": "*i64", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                "n_q_heads": "i32", "n_kv_heads": "i32", "stride_slot": "i32", "stride_pos": "i32",
                "k_out_ptr": "*bf16", "slot_step": "i32"}
        for hb, warps in ((1, 1), (64, 4)):  # a head per program (decode), a row per program (prefill)
            build(fused._rope_kv_kernel, rope, dict(HEAD_DIM=64, HB=hb, USE_PDL=pdl, K_OUT=True),
                  num_warps=warps, launch_pdl=pdl)
        for hb, warps in ((1, 1), (32, 8)):  # Phi-4-mini's partial rotary (96 of 128 dims), 24 + 8 heads
            build(fused._rope_kv_kernel, rope, dict(HEAD_DIM=128, HB=hb, USE_PDL=pdl, K_OUT=True, ROT=96, HALF_P=64,
                                                    TAIL_P=32), num_warps=warps, launch_pdl=pdl)
        build(fused._step_inputs_kernel, {"ids_ptr": "*i64", "pos_ptr": "*i64", "slot_ptr": "*i64", "embed_ptr": "*bf16",
                                          "h_ptr": "*bf16", "len_ptr": "*i32", "slot32_ptr": "*i32"},
              dict(hidden=2048, BLOCK=2048), num_warps=4)
        split_sig = {n: "i32" for n in td._split_kernel.arg_names}
        for n in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "out_ptr"):
            split_sig[n] = "*bf16"
        for n in ("part_ptr", "lse_ptr"):
            split_sig[n] = "*fp32"
        split_sig.update(slot_ptr="*i32", len_ptr="*i32", cnt_ptr="*i32", qk_scale="fp32")
        for preload, rope, from_cache in ((False, True, True), (True, True, True), (True, False, True),
                                          (True, True, False)):
            consts = dict(HEAD_DIM=64, BLOCK_G=16, BLOCK_N=64, DOT_PRECISION="tf32", FUSE_COMBINE=False, BLOCK_S=32,
                          ROPE=rope, USE_PDL=pdl, PRELOAD=preload, CUR_FROM_CACHE=from_cache,
                          MERGE_UNROLLED=False, MERGE_CH=8)
            sig = {n: t for n, t in split_sig.items() if n not in consts}
            build(td._split_kernel, sig, consts, num_warps=4, num_stages=3, launch_pdl=pdl)
        # the last split merging the others (FUSE_COMBINE), its live splits eight at a time
        consts.update(FUSE_COMBINE=True, MERGE_UNROLLED=True, BLOCK_S=64)
        build(td._split_kernel, sig, consts, num_warps=4, num_stages=3, launch_pdl=pdl)
        comb_sig = {n: "i32" for n in td._combine_kernel.arg_names}
        comb_sig.update(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16")
        for c in ("HEAD_DIM", "BLOCK_S", "USE_PDL"):
            comb_sig.pop(c)
        build(td._combine_kernel, comb_sig, dict(HEAD_DIM=64, BLOCK_S=32, USE_PDL=pdl), num_warps=2, launch_pdl=pdl)
    # the L2 prefetch beside attention: whole ranges, and the leading K tiles of each row
    build(l2_prefetch._prefetch_kernel, {"a_addr": "i64", "a_chunks": "i32", "b_addr": "i64", "b_chunks": "i32"},
          dict(CHUNK_BYTES=l2_prefetch.CHUNK, BLOCK=l2_prefetch.BLOCK), num_warps=1)
    build(l2_prefetch._prefetch_rows_kernel, {"addr": "i64", "rows": "i32", "stride": "i64"},
          dict(ROW_BYTES=512, BLOCK=l2_prefetch.BLOCK), num_warps=1)
    mega(2048, 32, 8, 64, 8192)  # Llama-3.2-1B
    mega(576, 9, 3, 64, 1536)  # SmolLM2-135M

def mega(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> None:
    """The mega kernel at a model's shapes, persistent (grid barriers) as the mega mode launches it."""
    sig = {n: "i32" for n in mk._decode_layers_kernel.arg_names}
    for n in ("embed_ptr", "wbase_ptr", "cos_ptr", "sin_ptr", "cache_ptr", "q_ptr", "attn_ptr", "act_ptr"):
        sig[n] = "*bf16"
    for n in ("h_ptr", "stats_ptr", "part_ptr", "ml_ptr"):
        sig[n] = "*fp32"
    sig.update(ids_ptr="*i64", pos_ptr="*i64", slot_ptr="*i64", woff_ptr="*i64", cnt_ptr="*i32", bar_ptr="*i32",
               stamp_ptr="*i32",
               eps="fp32", scale="fp32", stride_layer="i64", stride_slot="i64", stride_pos="i64")
    t = mk.pick_tiles(hidden, heads * head_dim, inter, head_dim, 132)
    consts = dict(H=hidden, HQ=heads, HKV=kv_heads, D=head_dim, INTER=inter, BN=t.bn, BNI=t.bni, PB=t.pb,
                  BKH=t.bkh, BKQ=t.bkq, BKI=t.bki, NP=gemv.next_pow2(mk.cdiv(hidden, t.bn)), PREC="tf32",
                  SYNC=True, WA=mk.WEIGHT_ALIGN, STAMP=False, MP=mk.ROWS_PAD, MPO=mk.ROWS_PAD,
                  SLEEP_NS=0,
                  **mk.items_per_program(hidden, heads, kv_heads, head_dim, inter, t, 132))
    build(mk._decode_layers_kernel, {n: v for n, v in sig.items() if n not in consts}, consts,
          num_warps=mk.NUM_WARPS, num_stages=mk.NUM_STAGES)


def _plane_sig(fmt: str) -> dict:
    """The plane pointers' types of `fmt` (p0..) and None for the unused ones."""
    types = [("*i8" if fmt == "Q8_0" and p == "qs" else "*bf16" if fmt == "int4" and p == "scale"
              else "*i8" if fmt == "Q6_K" and p == "sc" else PLANE_TYPES[p]) for p in PLANES[fmt]]
    return {f"p{i}": types[i] if i < len(types) else None for i in range(6)}


def _compile(fn, sig: dict, consts: dict, options: dict):
    sig = dict(sig, **{name: "constexpr" for name in consts})
    # pointers 16-byte aligned and strides multiples of 16, as the launches specialise them
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or a.startswith("stride_") and t in ("i32", "i64")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def compile_projection(fmt: str, n: int, k: int):
    """The compiled plain projection (M <= 16, bf16 x, no PDL) of an [n, k] weight in `fmt`."""
    _, kw = qgemv._kwargs(fmt, n, k, torch.bfloat16, 1, False, False, False, True, False, False, None)
    options = {o: kw.pop(o) for o in ("num_warps", "num_stages")}
    kw.pop("launch_pdl")
    planes = _plane_sig(fmt)
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "stride_y": "i32", "stride_split": "i32",
           "stride_p": "i32"}
    sig.update({p: t for p, t in planes.items() if t})
    consts = dict(kw, **{p: None for p, t in planes.items() if not t},
                  **{a: None for a in ("pmax_ptr", "pidx_ptr", "temp_ptr", "seed_ptr", "pos_ptr")})
    return _compile(qgemv._qproj_kernel, sig, consts, options), kw


def loop_counts(cubin: bytes) -> tuple[int, dict[str, int]]:
    """Instructions of the longest backward-branch loop of the kernel and their opcodes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels, instrs = {}, []
    for line in text:
        if m := re.match(r"\.L_x_(\d+):", line):
            labels[m.group(1)] = len(instrs)
        if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            instrs.append(line)
    loops = [(labels[m.group(1)], i) for i, line in enumerate(instrs)
             if (m := re.search(r"BRA\S*\s+`\(\.L_x_(\d+)\)", line)) and labels.get(m.group(1), i) < i]
    if not loops:
        return 0, {}
    start, end = max(loops, key=lambda t: t[1] - t[0])
    ops: dict[str, int] = {}
    for line in instrs[start:end + 1]:
        if m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line):
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return end - start + 1, ops


def quant(n: int, k: int, fmts: list[str]) -> None:
    """Instructions per weight of each format's projection at [n, k]."""
    for fmt in fmts:
        compiled, kw = compile_projection(fmt, n, k)
        count, ops = loop_counts(compiled.asm["cubin"])
        warps = compiled.metadata.num_warps
        per = count * warps / (kw["BLOCK_N"] * kw["BLOCK_K"])
        top = ", ".join(f"{o} {c}" for o, c in sorted(ops.items(), key=lambda t: -t[1])[:8])
        print(f"{fmt:5} {n}x{k} bn={kw['BLOCK_N']} bk={kw['BLOCK_K']} smem={compiled.metadata.shared}: "
              f"{count} instructions per warp and tile, {per:.3f} warp instructions per weight ({top})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", action="store_true", help="the quantized projection's instructions per weight")
    ap.add_argument("--shape", default="14336x4096", help="with --quant: N x K of the weight")
    ap.add_argument("formats", nargs="*", help=f"with --quant: formats (default all: {', '.join(PLANES)})")
    args = ap.parse_args()
    if args.quant:
        n, k = (int(v) for v in args.shape.split("x"))
        quant(n, k, args.formats or list(PLANES))
    else:
        main()
