"""Compiles kernels.qgemv's projection for sm_90 without a GPU and counts the SASS instructions of
its K loop per weight, per format: a by-design check of the quantized projections' arithmetic
against the memory bound (an H100 issues about 0.93e12 warp instructions a second; at 3.35 TB/s
a 4-bit weight stream leaves about 0.14 warp instructions per weight, an 8-bit one 0.28).

    python tools/qgemv_isa.py [N K [FMT ...]]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fgchat.engine.kernels import qgemv
from fgchat.engine.kernels.qtiles import PLANES

TARGET = GPUTarget("cuda", 90, 32)
PLANE_TYPES = {"qs": "*u8", "ql": "*u8", "qh": "*u8", "sc": "*u8", "mn": "*u8", "d": "*fp16", "dmin": "*fp16",
               "m": "*fp16", "w": "*fp8e4nv", "scale": "*fp32"}
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def compile_projection(fmt: str, n: int, k: int):
    """The compiled plain projection (M <= 16, bf16 x, no PDL) of an [n, k] weight in `fmt`."""
    _, kw = qgemv._kwargs(fmt, n, k, torch.bfloat16, 1, False, False, False, True, False, False, None)
    options = {o: kw.pop(o) for o in ("num_warps", "num_stages")}
    kw.pop("launch_pdl")
    types = [("*i8" if fmt == "Q8_0" and p == "qs" else "*bf16" if fmt == "int4" and p == "scale"
              else "*i8" if fmt == "Q6_K" and p == "sc" else PLANE_TYPES[p]) for p in PLANES[fmt]]
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "stride_y": "i32", "stride_split": "i32",
           "stride_p": "i32"}
    sig.update({f"p{i}": t for i, t in enumerate(types)})
    consts = dict(kw, **{f"p{i}": None for i in range(len(types), 6)},
                  **{a: None for a in ("pmax_ptr", "pidx_ptr", "temp_ptr", "seed_ptr", "pos_ptr")})
    fn = qgemv._qproj_kernel
    sig.update({name: "constexpr" for name in consts})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options), kw


def loop_counts(cubin: bytes) -> tuple[int, dict[str, int]]:
    """Instructions of the longest backward-branch loop of the kernel and their opcodes."""
    path = "/tmp/qgemv_isa.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    text = subprocess.run([NVDISASM, "-c", path], capture_output=True, text=True, check=True).stdout.splitlines()
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


def main() -> None:
    n, k = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (14336, 4096)
    fmts = sys.argv[3:] or list(PLANES)
    for fmt in fmts:
        compiled, kw = compile_projection(fmt, n, k)
        count, ops = loop_counts(compiled.asm["cubin"])
        warps = compiled.metadata.num_warps
        per = count * warps / (kw["BLOCK_N"] * kw["BLOCK_K"])
        top = ", ".join(f"{o} {c}" for o, c in sorted(ops.items(), key=lambda t: -t[1])[:8])
        print(f"{fmt:5} {n}x{k} bn={kw['BLOCK_N']} bk={kw['BLOCK_K']} smem={compiled.metadata.shared}: "
              f"{count} instructions per warp and tile, {per:.3f} warp instructions per weight ({top})")


if __name__ == "__main__":
    main()
