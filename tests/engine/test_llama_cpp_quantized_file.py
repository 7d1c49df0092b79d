"""A GGUF quantized by llama.cpp itself (an independent implementation of the block formats):
tests/engine/data/tiny-Q4_K_M.gguf was made by llama.cpp 0c1e570's llama-quantize (Q4_K_M) from
`python tools/random_gguf.py tiny --dtype bf16` (seed 0). Q4_K_M mixes formats: Q4_K everywhere,
Q6_K for layer 1's attn_v and ffn_down and for token_embd (the tied head), so layer 1's fused qkv is
a QuantStack. Checked: our reader's planes dequantize to gguf-py's values and to transformers'
conversion bit for bit; the kernels (Triton's interpreter) give the float64 product of those values
for the mixed qkv, a Q6_K down and the Q6_K head; the engine on CPU answers like --dequantize."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

FILE = Path(__file__).parent / "data" / "tiny-Q4_K_M.gguf"
ROOT = Path(__file__).resolve().parents[2]


def test_planes_equal_gguf_py_and_the_conversion(tmp_path, monkeypatch):
    from fgchat.engine.model.resolve import convert_gguf
    from fgchat.engine.model.weights import load_safetensors
    from fgchat.engine.quant.dequant import dense
    from fgchat.engine.quant.gguf_tensors import read_gguf_weights
    from fgchat.engine.quant.qweight import QuantWeight

    read = read_gguf_weights(FILE, 4, 2)
    assert read.formats() == ["Q4_K", "Q6_K"] and read.other_types == {}
    raw = {t.name: t for t in gguf.GGUFReader(FILE).tensors}
    v1 = read.tensors["model.layers.1.self_attn.v_proj.weight"]  # v rows are not permuted
    assert isinstance(v1, QuantWeight) and v1.fmt == "Q6_K"
    want = gguf.quants.dequantize(np.asarray(raw["blk.1.attn_v.weight"].data), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(dense(v1, torch.float32), torch.from_numpy(want.copy()))
    convert_gguf(FILE, tmp_path / "full", with_weights=True)  # transformers' float32 values
    conv = load_safetensors(tmp_path / "full")
    for name, t in read.tensors.items():
        assert torch.equal(dense(t, torch.float32), conv[name]), name


def test_kernels_on_the_files_blocks():
    """qgemv over the file's own blocks, in Triton's interpreter (a subprocess: the interpreter is
    chosen when triton is imported): mixed qkv, Q6_K down and the Q6_K head's float32 logits."""
    script = r'''
import sys, torch
sys.path.insert(0, "tests")
import interpreter_rounding; interpreter_rounding.install()
from fgchat.engine.quant.gguf_tensors import read_gguf_weights
from fgchat.engine.quant.dequant import dense
from fgchat.engine.quant.qweight import QuantStack, stack_rows
from fgchat.engine.kernels import qgemv
t = read_gguf_weights(sys.argv[1], 4, 2).tensors
for w in t.values():
    if not isinstance(w, torch.Tensor): w.dtype = torch.bfloat16
torch.manual_seed(0)
def check(x, w, out_bound):
    ref = x.double() @ dense(w, torch.float32).double().T
    got = qgemv.project(x, w).double()
    assert ((got - ref).abs() <= out_bound * ref.abs() + 1e-3).all(), (got - ref).abs().max()
qkv = stack_rows([t[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
assert isinstance(qkv, QuantStack) and qkv.fmt == "Q4_K+Q6_K"
for m in (1, 3):
    check(torch.randn(m, 256).bfloat16(), qkv, 2 ** -7)
check(torch.randn(2, 512).bfloat16(), t["model.layers.1.mlp.down_proj.weight"], 2 ** -7)
head = t["model.embed_tokens.weight"]
x = torch.randn(2, 256).bfloat16()
ref = x.double() @ dense(head, torch.float32).double().T
logits = qgemv.project_logits(x, head).double()
assert (logits - ref).abs().max() < 1e-4 and torch.equal(logits.argmax(1), ref.argmax(1))
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script, str(FILE)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-2000:]


def test_engine_on_cpu_answers_like_dequantize(tmp_path, monkeypatch):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams

    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))

    def greedy(**kw) -> tuple[list[int], Engine]:
        eng = Engine(EngineConfig(model=str(FILE), device="cpu", dtype="float32", max_context=128, **kw))
        rid = eng.submit([5, 9, 200, 31, 77], SamplingParams(max_tokens=12, ignore_eos=True))
        done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        return done[rid].token_ids, eng

    ours, eng = greedy()
    assert eng.model.weight_format.split("+")[0] in ("Q4_K", "Q6_K") and "as fp32" in eng.info().weights
    theirs, _ = greedy(dequantize=True)
    assert ours == theirs and len(ours) == 12
