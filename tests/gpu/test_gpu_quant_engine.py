"""Every weight format through the engine in every mode that takes it (eager, piecewise, full;
mega reads bf16 / fp16 only), on the GPU: a tiny Llama (hidden 256) whose projections are a GGUF's
blocks of one format (Q8_0, Q4_0, Q4_1: gguf-py's quantizer of random weights), llama.cpp's own
Q4_K_M and Q5_K_M files of the tiny preset (Q4_K / Q5_K with Q6_K; llama-quantize of
`tools/random_gguf.py tiny --dtype bf16`, seed 0: tests/engine/data), or --quantize fp8 / int4 of
the tiny Llama's bf16 weights. Per mode: the mode runs (no fallback), the start-up check passes
(the production path against the float32 forward over the same values), and every greedy token
of two prompts is the argmax of the float32 reference over the dequantized values (the CPU's
copies) run on the same tokens, or within 5% of the row's largest logit of it where the reference
nearly ties (bf16 activations over two random layers: a CPU bf16 run of the same values missed by
2.5%). Prints the
steps whose token is the exact argmax per (format, mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tiny_models
from quant_gguf_files import llama_blocks_gguf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("gguf")
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "fp8", "int4")
DATA = Path(__file__).resolve().parents[1] / "engine" / "data"
MODES = ("eager", "piecewise", "full")
PROMPTS = ([5, 9, 200, 31, 77, 12], [100, 3, 64, 250, 17, 8, 40, 41, 9])
STEPS = 12
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_models.build_model(tmp_path_factory.mktemp("quant_engine") / "llama", "llama", hidden=256,
                                   intermediate=512, heads=4, kv_heads=2, layers=2, seed=11, dtype="bfloat16")


def _model(fmt: str, model_dir, tmp_path, monkeypatch) -> tuple[str, dict]:
    """(the --model argument, EngineConfig extras) of `fmt`: llama.cpp's file, a GGUF resolved as
    if model_dir were its conversion, or model_dir with --quantize."""
    if fmt in ("fp8", "int4"):
        return str(model_dir), {"quantize": fmt}
    if fmt.endswith("_M"):
        monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))
        return str(DATA / f"tiny-{fmt}.gguf"), {}
    from fgchat.engine.model import resolve as resolve_mod

    path = tmp_path / f"tiny-{fmt}.gguf"
    llama_blocks_gguf(model_dir, path, dict.fromkeys(ROLES, fmt), None, seed=3)
    monkeypatch.setattr(resolve_mod, "resolve_model",
                        lambda arg, cache_dir=None: resolve_mod.ResolvedModel(model_dir, path.stem, "gguf"))
    return str(path), {}


def _reference(model: str, extra: dict):
    """Float32 logits [T, V] of a token sequence over the CPU's dequantized copies of the values."""
    from fgchat.engine.loader import load_model
    from fgchat.engine.model.decoder import Decoder
    from fgchat.engine.model.reference import reference_logits

    cpu = load_model(model, torch.device("cpu"), torch.float32, quantize=extra.get("quantize", "none"))
    dec = Decoder(cpu.cfg, cpu.weights, 64)
    return lambda ids: reference_logits(cpu.cfg, cpu.weights, torch.tensor(ids), dec.cos, dec.sin, dec.scale)


def _exact_steps(ref: torch.Tensor, start: int, tokens: list[int]) -> int:
    """Steps whose token is the reference's argmax at its row (rows start, start + 1, ...); any
    other token must be within 5% of the row's largest logit of the argmax's (a near tie in bf16),
    else the check fails."""
    exact = 0
    for j, tok in enumerate(tokens):
        row = ref[start + j]
        best = int(row.argmax())
        gap = float(row[best] - row[tok])
        assert gap <= 0.05 * float(row.abs().max()) + 1e-3, (j, tok, best, gap, float(row.abs().max()))
        exact += tok == best
    return exact


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_in_every_mode(fmt, model_dir, tmp_path, monkeypatch):
    from fgchat.engine.core import Engine
    from fgchat.protocol.config import EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams

    model, extra = _model(fmt, model_dir, tmp_path, monkeypatch)
    reference = _reference(model, extra)
    line = []
    for mode in MODES:
        eng = Engine(EngineConfig(model=model, device="cuda", mode=mode, max_context=128, **extra))
        while eng.capture_idle():  # the deferred start-up check and captures, as an idle engine runs them
            pass
        assert fmt.removesuffix("_M") in eng.model.weight_format, eng.model.weight_format
        sc = eng.startup_check
        assert sc is not None and sc.passed, (mode, sc)
        assert eng.mode == mode and not eng.modes.unavailable.get(eng.mode), (mode, eng.modes.unavailable)
        rids = [eng.submit(p, SamplingParams(max_tokens=STEPS, ignore_eos=True)) for p in PROMPTS]
        done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
        exact = []
        for p, rid in zip(PROMPTS, rids):
            toks = list(done[rid].token_ids)
            assert len(toks) == STEPS
            exact.append(_exact_steps(reference(list(p) + toks), len(p) - 1, toks))
        line.append(f"{mode} {'/'.join(map(str, exact))}")
        del eng
        torch.cuda.empty_cache()
    print(f"\n{fmt}: greedy steps equal to float32's argmax, of {STEPS} per prompt: " + ", ".join(line))
