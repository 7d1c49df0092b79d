"""A GGUF's conversion is bounded by the file's size on every supported transformers version: the
merges a vocabulary without merges implies equal a brute-force enumeration and, where transformers
derives them itself (GGUFTokenizerSkeleton), its own list; a 32k sentencepiece vocabulary without
merges (Llama 2's size) converts well within a minute; the metadata is read once, and no tensor
is read or dequantized by transformers."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fgchat.engine.model import resolve as resolve_mod
from fgchat.engine.model.gguf_metadata import MergePair, derived_merges

pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]
# a vocabulary with merges at several depths, a token listed twice, equal scores, halves holding
# spaces, and entries no split of which is in the vocabulary
TOKENS = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581ab", "ab", " ", "a b",
          "  ", "ca", "cab", "zz", "\u2581abc", "bca", "x y"]
SCORES = [0.0, -1.0, -2.0, -3.0, -4.0, -4.0, -6.0, -0.5, -7.0, -8.0, -4.5, -9.0, -10.0,
          -11.0, -12.0, -12.0, -13.0, -14.0, -6.0, -15.0]


def _brute_force(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of entries whose concatenation is an entry; order: the merged
    entry's score descending, then its first listing, then (left score, right score) descending,
    then shorter left first. An entry's score is its last listing's."""
    score = {t: s for t, s in zip(tokens, scores)}
    first = {t: tokens.index(t) for t in score}
    pairs = [(a, b) for a in score for b in score if a + b in score]
    return sorted(pairs, key=lambda ab: (-score[ab[0] + ab[1]], first[ab[0] + ab[1]],
                                         -score[ab[0]], -score[ab[1]], len(ab[0])))


def test_derived_merges_equal_brute_force() -> None:
    got = derived_merges(TOKENS, SCORES)
    assert [tuple(m.split(" ")) for m in got] == _brute_force(TOKENS, SCORES)
    spaced = [m for m in got if isinstance(m, MergePair)]
    assert spaced and all(" " in "".join(m.halves) for m in spaced)
    assert copy.deepcopy(got) == got
    assert [m.split(" ") for m in copy.deepcopy(spaced)] == [list(m.halves) for m in spaced]


def test_skeleton_given_merges_equals_its_own() -> None:
    """Where transformers derives missing merges itself, the list it keeps from ours is the list it
    derives: the tokenizer it builds is the same."""
    try:
        ggml = importlib.import_module("transformers.integrations.ggml")
    except ImportError:
        pytest.skip("no transformers.integrations.ggml")
    skeleton = getattr(ggml, "GGUFTokenizerSkeleton", None)
    if skeleton is None:
        pytest.skip("this transformers derives no merges through GGUFTokenizerSkeleton")
    plain = {"tokens": TOKENS, "scores": SCORES}
    own = skeleton(dict(plain)).merges
    given = skeleton(copy.deepcopy(dict(plain, merges=derived_merges(TOKENS, SCORES)))).merges
    assert own and given == own


def _llama_gguf(tmp_path: Path, vocab_size: int) -> Path:
    """A 1-layer llama GGUF (f32, hidden 64) with tools/random_gguf.py's synthetic sentencepiece
    vocabulary of `vocab_size` entries and no merges."""
    spec = importlib.util.spec_from_file_location("random_gguf", ROOT / "tools" / "random_gguf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 32, "vocab_size": vocab_size, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
           "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / f"v{vocab_size}.gguf"
    tool.write(str(tmp_path / "cfg" / "config.json"), out, "f32", quiet=True)
    return out


def test_32k_vocabulary_without_merges_converts_fast(tmp_path: Path) -> None:
    """transformers' own derivation of the merges (a list scan per split) takes minutes here;
    ours a fraction of a second. The conversion runs in a child so a slow path fails at the limit
    instead of hanging the suite."""
    gguf = _llama_gguf(tmp_path, 32000)
    code = ("import sys; from pathlib import Path; from fgchat.engine.model import resolve; "
            "resolve.convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))")
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", code, str(gguf), str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=45, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("converting a 32k vocabulary without merges took over 45 s (the slow merge derivation?)")
    took = time.perf_counter() - t0
    print(f"conversion of a 32k sentencepiece vocabulary without merges: {took:.1f} s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert not resolve_mod.has_weights(tmp_path / "out")


def test_metadata_read_once_and_no_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every binding of transformers' GGUF read counts its calls: one metadata read at most, no
    tensor read, no model built; where GGUFTokenizerSkeleton exists, it is always given merges."""
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    for name in ("transformers.configuration_utils", "transformers.tokenization_utils_tokenizers",
                 "transformers.tokenization_utils_fast", "transformers.models.auto.tokenization_auto",
                 "transformers.integrations.ggml"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    real = gguf_utils.load_gguf_checkpoint
    calls: list[bool] = []

    def counted(path, return_tensors=False, **kwargs):
        calls.append(bool(return_tensors))
        return real(path, return_tensors=return_tensors, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("transformers") and getattr(module, "__dict__", {}).get("load_gguf_checkpoint") is real:
            monkeypatch.setattr(module, "load_gguf_checkpoint", counted)

    def no_model(*args, **kwargs):
        raise AssertionError("the conversion built transformers' model (a float copy of the weights)")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    given: list[bool] = []
    skeleton = getattr(sys.modules.get("transformers.integrations.ggml"), "GGUFTokenizerSkeleton", None)
    if skeleton is not None:
        build = skeleton.__init__

        def watched(self, dict_):
            given.append("merges" in dict_)
            build(self, dict_)

        monkeypatch.setattr(skeleton, "__init__", watched)
    resolve_mod.convert_gguf(_llama_gguf(tmp_path, 600), tmp_path / "out")
    print(f"transformers GGUF reads (return_tensors): {calls}")
    assert all(given), "transformers derived the merges itself (vocabulary-squared time)"
    assert skeleton is None or given
    assert calls.count(False) <= 1 and True not in calls
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 600
