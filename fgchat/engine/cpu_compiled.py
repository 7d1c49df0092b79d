"""The CPU decode step as one natively compiled function (AOTInductor): every layer's norms,
products, RoPE, cache writes and attention in generated C++, instead of ~1,200 torch calls from
Python a step. Each product is inductor's C++ GEMM template (micro-kernels generated for that
weight's shape and this CPU's vector / matrix instructions, the weight packed for them) or
oneDNN's packed product, whichever timed faster while the package was built (`templates`; on a
2-vCPU Xeon with AMX the templates took the embedded model's batch-1 step from ~14 to ~8 ms).
Two packages per weights: one lane (batch 1, built at start) and LANES lanes (batches 2..LANES,
built once a batch first ran; the lanes a batch leaves empty write and read the cache's scratch
slot, one row).

Why: between two packed products a step's small torch calls run on caches the product's weight
stream just evicted (notes: decode-step.md, session 34), so a step spent ~8 ms on them against
~3 ms when they run alone. One compiled function has no calls between products.

A package is built once per (weights, dtype, cache shape, lanes, templates, threads, torch, CPU) by
`build_package` in a process of its own (`python -m fgchat.engine.cpu_compiled SPEC`: ~60 s for
one lane, ~100 s for eight, on two cores for the embedded model) and kept in the cache directory;
an engine loads it in about a second.

Invariants:
- the package's key hashes the weights themselves (a sample of every tensor's values, all shapes),
  the cache shape, the lanes, the dtype, the GEMM choice, torch's thread count and version, this
  file's source and the CPU's flags: a package is never used for other weights or another build;
- a package is written only after its step matched the eager decoder's logits on a probe prompt
  (within `PROBE_TOLERANCE` of their largest value) and picked the same token or one tied with it
  within that tolerance; written to a temporary name, then renamed, so a reader never sees a
  partial file; a build that failed leaves a `.failed` marker and is not tried again for its key;
- the compiled step reads and writes the engine's K/V cache in place: for each lane rows [0, pos]
  of its slot, row pos written first, exactly what the eager step touches; an empty lane (id 0,
  pos 0, the scratch slot: the cache's last, which no sequence is given) touches row 0 of the
  scratch slot alone, and lanes are independent rows of every product, so a lane's result does
  not depend on the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fgchat.engine.model.ops import apply_rope_rolled, rms_norm

if TYPE_CHECKING:
    from fgchat.engine.model.decoder import Decoder

# packages kept in the cache directory (the most recently used): one per weights, cache shape and
# lanes (two models' batch-1 and batch packages), ~1x the weights' bytes each
KEEP_PACKAGES = 4
# logits of the compiled step may differ from eager's by bf16 roundings the fused code skips
PROBE_TOLERANCE = 0.03
# lanes of the batch package: batches of 2..LANES sequences run through it, padded with empty lanes
LANES = 8


def compiler_available() -> bool:
    """A C++ compiler inductor can call (its default, `c++`/`g++`/`clang++`)."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


def fingerprint(dec: Decoder, cache_shape: tuple[int, ...], lanes: int = 1, templates: bool = True) -> str:
    """The package key (see the module's invariants)."""
    h = hashlib.sha256()
    w = dec.w
    tensors = [w.embed, w.final_norm, w.lm_head]
    for lw in w.layers:
        tensors += [lw.attn_norm, lw.wqkv, lw.wo, lw.mlp_norm, lw.w_gate_up, lw.w_down]
        if lw.bqkv is not None:
            tensors.append(lw.bqkv)
    for t in tensors:
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().contiguous()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(sample.numpy().tobytes())
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    # the GEMM templates' blocking and thread count are fixed when the package is generated
    h.update(repr((cache_shape, lanes, templates, torch.get_num_threads(), dec.cfg.rms_eps, torch.__version__,
                   flags)).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:24]


def package_path(root: Path, key: str) -> Path:
    return root / "cpu-step" / f"{key}.pt2"


def prune(folder: Path, keep: int = KEEP_PACKAGES) -> None:
    """Removes all but the `keep` most recently used packages (and their spec and log files)."""
    packages = sorted(folder.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in packages[keep:]:
        for f in (old, old.with_suffix(".json"), old.with_suffix(".log"), old.with_suffix(".failed")):
            f.unlink(missing_ok=True)


class _Step(torch.nn.Module):
    """One decode step of N lanes over the engine's caches: (ids [N], pos [N], slot [N],
    K_0..K_{L-1}, V_0..V_{L-1}) -> the residual stream [N, H] before the final norm; N is fixed
    when the step is exported."""

    def __init__(self, dec: Decoder) -> None:
        super().__init__()
        c = dec.cfg
        self.c = c
        self.scale = dec.scale
        self.register_buffer("embed", dec.w.embed)
        self.register_buffer("cos", dec.cos)
        self.register_buffer("ssin", dec.ssin)
        self.lin = torch.nn.ModuleList()
        for i, lw in enumerate(dec.w.layers):
            self.register_buffer(f"attn_norm{i}", lw.attn_norm)
            self.register_buffer(f"mlp_norm{i}", lw.mlp_norm)
            for w, b in ((lw.wqkv, lw.bqkv), (lw.wo, None), (lw.w_gate_up, None), (lw.w_down, None)):
                m = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
                m.weight = torch.nn.Parameter(w, requires_grad=False)
                if b is not None:
                    m.bias = torch.nn.Parameter(b, requires_grad=False)
                self.lin.append(m)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        c = self.c
        n_layers = len(kv) // 2
        slots, length = kv[0].shape[0], kv[0].shape[1]
        n = ids.shape[0]
        lanes = []  # (pos, slot) of each lane as host values: each lane's rows are a view
        for j in range(n):
            p, s = pos[j].item(), slot[j].item()
            torch._check(p >= 0)
            torch._check(p < length)
            torch._check(s >= 0)
            torch._check(s < slots)
            lanes.append((p, s))
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qk_end = c.q_size + c.kv_size
        h = F.embedding(ids, self.embed)
        cos, ssin = self.cos[pos], self.ssin[pos]
        for i in range(n_layers):
            k_cache, v_cache = kv[i], kv[n_layers + i]
            x = rms_norm(h, getattr(self, f"attn_norm{i}"), c.rms_eps)
            qkv = self.lin[4 * i](x)
            qk = apply_rope_rolled(qkv[:, :qk_end].view(n, nh + nkv, d), cos, ssin)
            k_cache.index_put_((slot, pos), qk[:, nh:])
            v_cache.index_put_((slot, pos), qkv[:, qk_end:].view(n, nkv, d))
            heads = []
            for j, (p, s) in enumerate(lanes):
                k = k_cache[s, : p + 1].permute(1, 0, 2).unsqueeze(0)
                v = v_cache[s, : p + 1].permute(1, 0, 2).unsqueeze(0)
                q = qk[j : j + 1, :nh].unsqueeze(2)  # [1, nh, 1, d]
                a = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=nh != nkv)
                heads.append(a.reshape(1, c.q_size))
            h = h + self.lin[4 * i + 1](heads[0] if n == 1 else torch.cat(heads))
            x = rms_norm(h, getattr(self, f"mlp_norm{i}"), c.rms_eps)
            g, u = self.lin[4 * i + 2](x).chunk(2, dim=-1)
            h = h + self.lin[4 * i + 3](F.silu(g) * u)
        return h


class CompiledStep:
    """A loaded package of `lanes` lanes: `run(ids, pos, slot)` -> h [b, H] for b <= lanes
    sequences (the caches are bound at load; the lanes past b run empty in the scratch slot)."""

    def __init__(self, fn, caches: list[torch.Tensor], lanes: int = 1) -> None:  # noqa: ANN001
        self._fn = fn
        self._caches = caches
        self.lanes = lanes
        # ids, pos, slot of every lane; rows past a step's b hold the empty lane's values
        self._padded = torch.zeros(3, lanes, dtype=torch.int64)
        self._scratch = caches[0].shape[0] - 1

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        if b == self.lanes:
            return self._fn(ids, pos, slot, *self._caches)
        lane = self._padded
        lane[:, b:] = 0
        lane[2, b:] = self._scratch
        lane[0, :b], lane[1, :b], lane[2, :b] = ids, pos, slot
        return self._fn(lane[0], lane[1], lane[2], *self._caches)[:b]


def load(path: Path, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], lanes: int = 1) -> CompiledStep:
    fn = torch._inductor.aoti_load_package(str(path))
    return CompiledStep(fn, list(k_caches) + list(v_caches), lanes)


def build_package(dec: Decoder, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], path: Path,
                  lanes: int = 1, templates: bool = True) -> None:
    """Export and compile the step of `lanes` lanes, check it against the eager decoder on a probe
    prompt in slot 0 (its rows are overwritten), then write the package to `path`. templates: each
    product is timed as inductor's C++ GEMM template and as oneDNN's packed product while compiling,
    and the faster is generated (else oneDNN's throughout). Raises RuntimeError when the check fails."""
    import torch._inductor.config as inductor_config

    caches = list(k_caches) + list(v_caches)
    module = _Step(dec).eval()
    example = (torch.ones(lanes, dtype=torch.int64), torch.zeros(lanes, dtype=torch.int64),
               torch.arange(lanes), *caches)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
    # freezing: the weights become constants, so inductor packs them for oneDNN or for its templates
    settings: dict[str, object] = {"freezing": True}
    if templates:
        settings.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    with torch.inference_mode(False), torch.no_grad(), inductor_config.patch(settings):
        exported = torch.export.export(module, example, strict=False)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp))
    try:
        check(dec, load(tmp, k_caches, v_caches, lanes), k_caches, v_caches)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@torch.inference_mode()
def check(dec: Decoder, step: CompiledStep, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    """The compiled step after an eager prefill of a probe prompt against the eager prefill of the
    prompt one token longer: logits within PROBE_TOLERANCE of their largest value, and the same
    argmax unless the two are within that tolerance of each other in the eager logits (a near tie).
    A package of several lanes runs two probes of different lengths, in slots 0 and 1, beside
    empty lanes."""
    vocab = dec.cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    probes = [torch.randint(0, vocab, (n,), generator=g) for n in ((24,) if step.lanes == 1 else (24, 17))]
    wants = []
    for slot, ids in enumerate(probes):
        wants.append(dec.prefill(ids, slot, k_caches, v_caches))
        dec.prefill(ids[:-1], slot, k_caches, v_caches)
    h = step.run(torch.stack([ids[-1] for ids in probes]), torch.tensor([len(ids) - 1 for ids in probes]),
                 torch.arange(len(probes)))
    for want, got in zip(wants, dec.head_logits(rms_norm(h, dec.w.final_norm, dec.cfg.rms_eps))):
        scale = float(want.abs().max())
        err = float((got.float() - want.float()).abs().max())
        tie = float(want.max() - want[int(got.argmax())]) <= PROBE_TOLERANCE * scale
        if not torch.isfinite(got).all() or err > PROBE_TOLERANCE * scale or not tie:
            raise RuntimeError(f"the compiled step left the eager decoder's logits by {err:.4g} (largest {scale:.4g})")


def main(argv: list[str]) -> int:
    """The child process: SPEC is a JSON file {"config": EngineConfig fields, "max_context": T,
    "path": where to write, "key": the engine's fingerprint}. Exits 0 when the package exists."""
    spec = json.loads(Path(argv[0]).read_text())
    os.nice(10)  # beside an engine that is serving eagerly
    from fgchat.engine.kv_cache import KVCache
    from fgchat.engine.loader import load_model, load_random, pick_dtype
    from fgchat.engine.model.decoder import Decoder
    from fgchat.protocol.tuning import Tuning

    cfg = spec["config"]
    device = torch.device("cpu")
    dtype = pick_dtype(cfg["dtype"], device)
    if cfg.get("preset"):
        loaded = load_random(cfg["preset"], device, dtype, cfg.get("seed", 0), cfg.get("outliers", 0.0))
    else:
        loaded = load_model(cfg.get("model"), device, dtype)
    dec = Decoder(loaded.cfg, loaded.weights, spec["max_context"], False, Tuning())
    cache = KVCache(loaded.cfg, spec["max_context"], device, dtype, extra_slots=spec.get("extra_slots", 0))
    lanes, templates = spec.get("lanes", 1), spec.get("gemm_templates", True)
    key = fingerprint(dec, tuple(cache.k[0].shape), lanes, templates)
    if key != spec["key"]:
        print(f"cpu step: the weights loaded here differ from the engine's ({key} != {spec['key']})", file=sys.stderr)
        return 2
    path = Path(spec["path"])
    try:
        build_package(dec, cache.k, cache.v, path, lanes, templates)
    except Exception as exc:  # noqa: BLE001 - any failure: said once, not retried for this key
        path.with_suffix(".failed").write_text(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        raise
    return 0


class Builder:
    """An engine's compiled step: its package loaded where it exists, else built by a child
    process (`main`) while the engine serves eagerly; `poll()` loads it when it is there."""

    def __init__(self, dec: Decoder, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 spec: dict, root: Path, lanes: int = 1) -> None:
        self.k, self.v = k_caches, v_caches
        self.lanes = lanes
        self.key = fingerprint(dec, tuple(k_caches[0].shape), lanes, spec.get("gemm_templates", True))
        self.path = package_path(root, self.key)
        self.spec = {**spec, "key": self.key, "path": str(self.path), "lanes": lanes}
        self.proc = None
        self.failed: str | None = None
        self.log = self.path.with_suffix(".log")
        self._load_due = False

    def start(self) -> None:
        """A package to load at the next poll where it exists; else the child is started."""
        if self.path.is_file():
            self._load_due = True
            return
        marker = self.path.with_suffix(".failed")
        if marker.is_file():  # an earlier build of these weights failed: not tried again
            self.failed = f"its build failed before: {marker.read_text(errors='replace').strip()} ({marker})"
            return
        if not compiler_available():
            self.failed = "no C++ compiler (c++, g++ or clang++) on PATH"
            return
        import subprocess

        self.path.parent.mkdir(parents=True, exist_ok=True)
        prune(self.path.parent, KEEP_PACKAGES - 1)  # room for the one this child writes
        spec_file = self.path.with_suffix(".json")
        spec_file.write_text(json.dumps(self.spec))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "fgchat.engine.cpu_compiled", str(spec_file)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def building(self) -> bool:
        return self.proc is not None

    @property
    def pending(self) -> bool:
        """A poll has something to do: a package to load or a child to wait for."""
        return self._load_due or self.proc is not None

    def poll(self, wait: bool = False) -> CompiledStep | None:
        """The loaded step once its package is there (wait: until the child has ended)."""
        if self.proc is not None:
            rc = self.proc.wait() if wait else self.proc.poll()
            if rc is None:
                return None
            self.proc = None
            if rc != 0 or not self.path.is_file():
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.is_file() else []
                self.failed = f"its build exited {rc}: {tail[0] if tail else 'no output'} (log: {self.log})"
                return None
            self._load_due = True
        if not self._load_due:
            return None
        self._load_due = False
        try:
            self.path.touch()  # recently used: kept by prune
            return load(self.path, self.k, self.v, self.lanes)
        except (RuntimeError, OSError) as exc:  # a package this torch cannot load: built again next time
            self.failed = f"cannot load {self.path}: {exc}"
            self.path.unlink(missing_ok=True)
            return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
