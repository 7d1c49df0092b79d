"""A model's generation_config.json as the default sampling: reading it (tolerant), the loader and
EngineInfo, `fgchat generate` flags and --json, and penalties against transformers' `generate`.

The real Hugging Face files of Qwen2.5-Instruct and Llama-3.2-Instruct could not be fetched
offline; the dicts below are written with their published values instead (see each comment).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fgchat.engine.model.generation_config import (
    describe_sampling,
    parse_generation_config,
    read_generation_config,
)
from fgchat.protocol.events import RequestFinished, SamplingParams

# Qwen2.5-Instruct's generation_config.json, as the 3B/7B repos ship it (the 0.5B and 1.5B repos
# differ only in repetition_penalty, 1.1 as far as could be checked offline)
QWEN25_INSTRUCT = {
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
    "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 0.7,
    "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0",
}
# Llama-3.2-1B/3B-Instruct's generation_config.json
LLAMA32_INSTRUCT = {
    "bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
    "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0.dev0",
}
# what transformers writes for a model without sampling settings (SmolLM2-135M-Instruct's, and
# the embedded GGUF's converted directory)
NO_SAMPLING = {
    "_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "transformers_version": "4.42.3",
}


def write_gc(d: Path, content: dict | str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content, indent=2)
    (d / "generation_config.json").write_text(text, encoding="utf-8")
    return d


# ---------------------------------------------------------------------------- reading the file
def test_qwen_defaults(tmp_path):
    values, note = read_generation_config(write_gc(tmp_path, QWEN25_INSTRUCT))
    assert note == ""
    assert values == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                      "repetition_penalty": 1.05}
    p = SamplingParams.from_generation_config(values)
    p.validate()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    assert describe_sampling(p) == "T 0.7 top-p 0.8 top-k 20, repetition 1.05"


def test_llama_defaults(tmp_path):
    values, note = read_generation_config(write_gc(tmp_path, LLAMA32_INSTRUCT))
    assert note == "" and values == {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    p = SamplingParams.from_generation_config(values)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 0, 1.0)
    assert describe_sampling(p) == "T 0.6 top-p 0.9"


def test_no_sampling_keys_means_empty(tmp_path):
    assert read_generation_config(write_gc(tmp_path, NO_SAMPLING)) == ({}, "")
    assert read_generation_config(tmp_path / "nowhere") == ({}, "")
    assert describe_sampling(SamplingParams.from_generation_config({})) == "greedy"


def test_do_sample_false_is_greedy_but_keeps_repetition(tmp_path):
    gc = {"do_sample": False, "temperature": 0.9, "top_p": 0.5, "repetition_penalty": 1.2}
    values, note = read_generation_config(write_gc(tmp_path, gc))
    assert note == "" and values == gc
    p = SamplingParams.from_generation_config(values)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0.0, 1.0, 1.2)
    assert describe_sampling(p) == "greedy, repetition 1.2"


@pytest.mark.parametrize("text,needle", [
    ("{ not json", "generation_config.json is not valid JSON (line 1); using greedy sampling"),
    ('{"do_sample": true,\n "temperature": 0.7,}', "not valid JSON (line 2)"),
    ("[1, 2]", "generation_config.json is not a JSON object; using greedy sampling"),
    ("", "not valid JSON"),
])
def test_malformed_file_is_empty_with_one_line_note(tmp_path, text, needle):
    values, note = read_generation_config(write_gc(tmp_path, text))
    assert values == {}
    assert needle in note and "\n" not in note


def test_not_utf8_is_a_note(tmp_path):
    tmp_path.joinpath("generation_config.json").write_bytes(b'{"temperature": 0.7\xff}')
    values, note = read_generation_config(tmp_path)
    assert values == {} and note.startswith("cannot read generation_config.json")


def test_bad_values_are_dropped_and_named(tmp_path):
    gc = {"do_sample": "yes", "temperature": -1, "top_p": 0, "top_k": 20.5, "repetition_penalty": "1.1",
          "max_new_tokens": 10}
    values, note = read_generation_config(write_gc(tmp_path, gc))
    assert values == {}
    for key in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty"):
        assert key in note
    assert "max_new_tokens" not in note and "\n" not in note
    gc = {"do_sample": True, "temperature": float("inf"), "top_p": 1.5, "top_k": -1,
          "repetition_penalty": 0, "_from_model_config": True}
    values, note = read_generation_config(write_gc(tmp_path, json.dumps(gc).replace("Infinity", "1e999")))
    assert values == {"do_sample": True, "temperature": 1.0} and note.count("(must") == 4
    # sane values next to bad ones are kept, and the result always validates
    values, note = parse_generation_config({"do_sample": True, "temperature": 1000, "top_p": 0.5,
                                            "top_k": 40.0, "repetition_penalty": True})
    assert values == {"do_sample": True, "top_p": 0.5, "top_k": 40, "temperature": 1.0}
    assert [n.split("=")[0] for n in note] == ["temperature", "repetition_penalty"]
    SamplingParams.from_generation_config(values).validate()


def test_null_values_are_unset(tmp_path):
    values, note = read_generation_config(write_gc(tmp_path, {"do_sample": False, "temperature": None}))
    assert values == {"do_sample": False} and note == ""
    # do_sample alone samples at transformers' default temperature (1.0), top-k only when stated
    values, note = read_generation_config(write_gc(tmp_path, {"do_sample": True, "temperature": None}))
    assert values == {"do_sample": True, "temperature": 1.0} and note == ""
    assert describe_sampling(SamplingParams.from_generation_config(values)) == "T 1"


# ---------------------------------------------------------------------------- loader and engine
@pytest.fixture
def qwen_like(tiny_model_dirs, tmp_path) -> Path:
    """The tiny qwen2 model with Qwen2.5-Instruct's generation_config.json."""
    d = tmp_path / "qwen-like"
    shutil.copytree(tiny_model_dirs["qwen2"], d)
    return write_gc(d, QWEN25_INSTRUCT)


def test_loader_and_engine_info(qwen_like, tmp_path, tiny_llama):
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.loader import load_model

    loaded = load_model(str(qwen_like), torch.device("cpu"), torch.float32)
    assert loaded.generation_config["repetition_penalty"] == 1.05 and loaded.notes == []
    info = Engine(EngineConfig(device="cpu", max_context=64), loaded).info()
    assert info.sampling_defaults == SamplingParams.from_generation_config(QWEN25_INSTRUCT)
    assert info.sampling_source == "generation_config.json"

    plain = load_model(str(tiny_llama), torch.device("cpu"), torch.float32)
    assert plain.generation_config == {} and plain.notes == []

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    write_gc(broken, "[1, 2]")
    loaded = load_model(str(broken), torch.device("cpu"), torch.float32)
    assert loaded.generation_config == {}
    assert loaded.notes == ["generation_config.json is not a JSON object; using greedy sampling"]
    info = Engine(EngineConfig(device="cpu", max_context=64), loaded).info()
    assert info.sampling_defaults == SamplingParams() and info.sampling_source == ""

    write_gc(broken, {"do_sample": True, "temperature": -1, "top_p": 0.9})
    loaded = load_model(str(broken), torch.device("cpu"), torch.float32)
    assert loaded.generation_config == {"do_sample": True, "top_p": 0.9, "temperature": 1.0}
    assert len(loaded.notes) == 1 and "ignored temperature=-1 (must be between 0 and 100)" in loaded.notes[0]


def test_loader_tolerates_invalid_json(tiny_llama, tmp_path):
    from fgchat.engine.loader import load_model

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    write_gc(broken, "{oops")
    loaded = load_model(str(broken), torch.device("cpu"), torch.float32)
    assert loaded.generation_config == {} and "not valid JSON" in loaded.notes[0]


@pytest.mark.slow
def test_embedded_model_defaults_to_its_model_card_sampling():
    """The embedded SmolLM2 GGUF converts to a generation_config.json without sampling keys; its
    greedy replies loop, so it defaults to its model card's T 0.2, top-p 0.9, shown as the source."""
    from fgchat.engine.core import Engine, EngineConfig
    from fgchat.engine.loader import load_model
    from fgchat.engine.model.resolve import resolve_model

    path = resolve_model(None).path
    assert (path / "generation_config.json").is_file()
    assert read_generation_config(path) == ({}, "")

    loaded = load_model(None, torch.device("cpu"), torch.float32)
    # the one note: its Q4_1 weights run as dequantized copies on CPU (no generation_config note)
    assert len(loaded.notes) == 1 and "Q4_1+Q8_0 weights run on CPU" in loaded.notes[0]
    info = Engine(EngineConfig(device="cpu", max_context=64), loaded).info()
    assert info.sampling_defaults == SamplingParams(temperature=0.2, top_p=0.9)
    assert info.sampling_source == "SmolLM2 model card"
    assert describe_sampling(info.sampling_defaults) == "T 0.2 top-p 0.9"


# ---------------------------------------------------------------------------- fgchat generate
def generate_json(capsys, *args: str) -> tuple[dict, str]:
    from fgchat.cli import main

    rc = main(["generate", "--device", "cpu", "--max-context", "64", "--max-tokens", "4", "--json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


def test_generate_uses_model_defaults(qwen_like, capsys):
    obj, err = generate_json(capsys, "--model", str(qwen_like), "--prompt", "Hello")
    s = obj["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["repetition_penalty"]) == (0.7, 0.8, 20, 1.05)
    assert obj["sampling_source"] == "generation_config.json"
    assert "| sampling T 0.7 top-p 0.8 top-k 20, repetition 1.05 (generation_config.json)" in err


def test_generate_flags_override_one_value_each(qwen_like, capsys):
    obj, err = generate_json(capsys, "--model", str(qwen_like), "--prompt", "Hello", "--temperature", "0.3",
                             "--presence-penalty", "0.5", "--seed", "7")
    s = obj["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["repetition_penalty"]) == (0.3, 0.8, 20, 1.05)
    assert (s["presence_penalty"], s["frequency_penalty"], s["seed"]) == (0.5, 0.0, 7)
    assert obj["sampling_source"] == "generation_config.json + --temperature + --presence-penalty"
    assert "presence 0.5" in err


def test_generate_greedy_ignores_model_sampling(qwen_like, capsys):
    obj, err = generate_json(capsys, "--model", str(qwen_like), "--prompt", "Hello", "--greedy")
    s = obj["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["repetition_penalty"]) == (0.0, 1.0, 0, 1.0)
    assert obj["sampling_source"] == "--greedy"
    again, _ = generate_json(capsys, "--model", str(qwen_like), "--prompt", "Hello", "--greedy", "--seed", "9")
    assert again["token_ids"] == obj["token_ids"]  # deterministic whatever the seed
    obj, _ = generate_json(capsys, "--model", str(qwen_like), "--prompt", "Hello", "--greedy",
                           "--repetition-penalty", "1.3")
    assert obj["sampling"]["repetition_penalty"] == 1.3
    assert obj["sampling_source"] == "--greedy + --repetition-penalty"


def test_generate_without_model_sampling_is_greedy(tiny_llama, capsys):
    obj, err = generate_json(capsys, "--model", str(tiny_llama), "--prompt", "Hello")
    assert obj["sampling"]["temperature"] == 0.0 and obj["sampling_source"] == "built-in greedy"
    assert "| sampling greedy (built-in greedy)" in err


def test_generate_n_with_greedy_default_samples(tiny_llama, qwen_like, capsys):
    """--n > 1 at temperature 0 samples at T 0.7 (as the TUI's K > 1); --greedy keeps n copies."""
    obj, _ = generate_json(capsys, "--model", str(tiny_llama), "--prompt", "Hello", "--n", "3", "--seed", "4")
    assert obj["sampling"]["temperature"] == 0.7
    assert obj["sampling_source"] == "built-in greedy + --n 3 at T 0.7"
    assert [c["seed"] for c in obj["completions"]] == [4, 5, 6]
    obj, _ = generate_json(capsys, "--model", str(tiny_llama), "--prompt", "Hello", "--n", "3", "--greedy")
    assert obj["sampling"]["temperature"] == 0.0
    assert len({tuple(c["token_ids"]) for c in obj["completions"]}) == 1
    obj, _ = generate_json(capsys, "--model", str(qwen_like), "--prompt", "Hello", "--n", "2")
    assert obj["sampling"]["temperature"] == 0.7 and obj["sampling_source"] == "generation_config.json"


def test_generate_json_subprocess(qwen_like):
    """The same through the installed entry point, as a user runs it."""
    p = subprocess.run([sys.executable, "-m", "fgchat.cli", "generate", "--model", str(qwen_like), "--prompt",
                        "Hi", "--max-tokens", "3", "--json", "--device", "cpu", "--max-context", "64"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["sampling"]["top_k"] == 20 and obj["sampling_source"] == "generation_config.json"


def test_generate_shows_generation_config_note(tiny_llama, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    write_gc(broken, {"do_sample": True, "top_k": "many"})
    obj, err = generate_json(capsys, "--model", str(broken), "--prompt", "Hello")
    notes = [ln for ln in err.splitlines() if "generation_config.json: ignored top_k=" in ln]
    assert len(notes) == 1 and notes[0].startswith("fgchat: ")
    # do_sample true and nothing else: the model samples at transformers' default temperature
    assert obj["sampling_source"] == "generation_config.json"
    assert obj["sampling"]["temperature"] == 1.0 and obj["sampling"]["top_k"] == 0


@pytest.mark.parametrize("args,needle", [
    (["--repetition-penalty", "0"], "repetition penalty must be in (0, 10]"),
    (["--repetition-penalty", "11"], "repetition penalty must be in (0, 10]"),
    (["--repetition-penalty", "nan"], "repetition penalty"),
    (["--presence-penalty", "2.5"], "presence penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "frequency penalty must be in [-2, 2]"),
    (["--frequency-penalty", "x"], "--frequency-penalty: invalid float value"),
    (["--greedy", "--temperature", "0.5"], "--temperature: not allowed with argument --greedy"),
    (["--greedy=1"], "--greedy: ignored explicit argument"),
    (["--seed", "-1", "--n", "3"], "seed must be in [0, 2^63), got -1"),
    (["--seed", str(2**63 - 2), "--n", "3"], "the seeds seed..seed+n-1 must all be in [0, 2^63)"),
])
def test_bad_sampling_flags_are_one_line(capsys, args, needle):
    from fgchat.cli import main

    # no model exists at this path: the check must fail before any loading
    try:
        rc = main(["generate", "--model", "/nonexistent/model", "--prompt", "hi", *args])
    except SystemExit as e:  # argparse's own checks exit from parse_args
        rc = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0]


# ---------------------------------------------------------------------------- vs transformers
def _hf_reference(model, prompt: list[int], n: int, rep: float, pres: float, freq: float) -> list[int]:
    """Greedy decoding with transformers' repetition processor, then OpenAI's presence /
    frequency formula over the generated tokens, one forward pass per token."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
        logits = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([ids]), logits)[0]
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        tok = int(logits.argmax())
        ids.append(tok)
        out.append(tok)
    return out


@pytest.fixture(scope="module")
def parity(tiny_model_dirs):
    transformers = pytest.importorskip("transformers")
    from fgchat.engine.core import Engine, EngineConfig

    path = tiny_model_dirs["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_context=256))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    return ref, eng, prompts


def _run(eng, prompt_params: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    rids = [eng.submit(p, sp) for p, sp in prompt_params]
    done = {e.summary.request_id: e.summary for e in eng.run_until_done() if isinstance(e, RequestFinished)}
    return [done[r].token_ids for r in rids]


N_TOKENS = 24


def test_greedy_without_penalty_matches_transformers(parity):
    """The baseline the penalty tests build on (fails for reasons other than penalties)."""
    ref, eng, prompts = parity
    want = ref.generate(torch.tensor([prompts[0]]), max_new_tokens=N_TOKENS, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(prompts[0]):].tolist()
    assert _run(eng, [(prompts[0], SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))]) == [want]
    penalized = ref.generate(torch.tensor([prompts[0]]), max_new_tokens=N_TOKENS, do_sample=False,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)[0, len(prompts[0]):]
    assert penalized.tolist() != want, "the penalty must change this model's greedy text, or the tests below prove nothing"


def test_greedy_repetition_penalty_matches_transformers_generate(parity):
    ref, eng, prompts = parity
    want = [ref.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, do_sample=False, repetition_penalty=rep,
                         eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p, rep in zip(prompts, (1.5, 1.0))]
    # a penalized and an unpenalized request in one batch, each as transformers decodes it alone
    got = _run(eng, [(p, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True, repetition_penalty=rep))
                     for p, rep in zip(prompts, (1.5, 1.0))])
    assert got == want


def test_presence_frequency_match_reference_loop(parity):
    ref, eng, prompts = parity
    cases = [(1.2, 0.5, 0.3), (1.0, 0.0, 1.0)]
    want = [_hf_reference(ref, p, N_TOKENS, *c) for p, c in zip(prompts, cases)]
    assert want[1] != _hf_reference(ref, prompts[1], N_TOKENS, 1.0, 0.0, 0.0)
    got = _run(eng, [(p, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True, repetition_penalty=r,
                                        presence_penalty=pr, frequency_penalty=f))
                     for p, (r, pr, f) in zip(prompts, cases)])
    assert got == want


def test_a_top_k_past_any_vocabulary_means_every_token():
    p = SamplingParams(temperature=1.0, top_k=10**23)
    p.validate()
    assert p.top_k == 0 and torch.tensor([p.top_k]).item() == 0
    assert SamplingParams(top_k=50).top_k == 50
