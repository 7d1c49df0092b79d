#!/usr/bin/env bash
# llama.cpp as a peer: built from source and measured with fgchat bench's settings (random weights
# of a preset's shape in bf16 and f16, prompt 512, 128 new tokens, batch 1 and 8, CUDA graphs and
# flash attention on), so that its rows can sit beside fgchat's from the same machine and session.
#
# With network, once:
#   bash scripts/llama_cpp.sh source    # -> .llamacpp/src.tgz (4.7 MB): llama.cpp trimmed to what
#                                       #    llama-batched-bench needs, from the llama-cpp-python
#                                       #    sdist's vendor/llama.cpp (commit recorded inside)
#   bash scripts/llama_cpp.sh wheels    # -> .llamacpp/wheels/ (30 MB): cmake + ninja wheels, only
#                                       #    for a GPU machine without cmake (the build says so)
# On the GPU machine (no network needed; .whl holds the gguf wheel tools/random_gguf.py needs where
# the venv lacks it):
#   bash scripts/llama_cpp.sh build cuda && bash scripts/llama_cpp.sh bench llama-3.2-1b smollm2-135m
#   bash scripts/llama_cpp.sh quantize llama-3.2-1b llama-3.1-8b   # Q8_0 and Q4_K_M files of the
#   DTYPES="bf16 Q8_0 Q4_K_M" bash scripts/llama_cpp.sh bench llama-3.2-1b   # random bf16 weights
# nvcc must be there (the build stops with a message if not); cuBLAS comes from the toolkit or,
# failing that, from the pip nvidia-cublas a CUDA torch brings. The CUDA build (sm_90 only) takes
# ~5 min on 16 cores; a build cut off resumes where it stopped when the same command runs again.
# tools/gpu_run.sh's `peers` target runs the bench and fgchat's bench one after the other.
# Results: $OUT/llamacpp.json (one row per preset, dtype and batch size) and $OUT/llamacpp.log.
#
# Commands:
#   source            fetch the sdist (PyPI's simple JSON API), write .llamacpp/src.tgz
#   wheels            pip download cmake and ninja wheels (manylinux x86_64) to .llamacpp/wheels
#   build [cpu|cuda]  extract src.tgz under $LLAMACPP_WORK, cmake, build llama-batched-bench and
#                     llama-quantize only
#   quantize PRESET...  the preset's random bf16 GGUF quantized by llama-quantize to each of QUANTS:
#                     $LLAMACPP_WORK/gguf/PRESET-TYPE.gguf (kept: a second call reuses them)
#   bench PRESET...   random GGUF per preset (tools/random_gguf.py: llama, Qwen3 and Gemma 3
#                     presets, in llama.cpp's llama / qwen3 / gemma3 architecture), llama-batched-bench, JSON;
#                     a DTYPES entry that is a quantization type benches PRESET-TYPE.gguf (made
#                     as `quantize` makes it, if missing); an argument ending in .gguf is benched
#                     as that file (dtype "file")
#   A PRESET is a name in fgchat/presets or a path to a config.json (named in files and rows by
#   its stem, or its folder's name for config.json).
# Environment:
#   LLAMACPP_WORK  where sources, builds and GGUFs go (default /tmp/llamacpp)
#   OUT            results (default /tmp/llamacpp-out)
#   DTYPES         weight dtypes to bench, space separated: bf16, f16, f32, or one of QUANT_TYPES
#                  (default "bf16 f16")
#   QUANTS         types `quantize` makes, space separated, from QUANT_TYPES (default "Q8_0 Q4_K_M")
#   BATCHES        batch sizes (default "1,8"); REPEATS timed runs per batch size after one
#                  warm-up run (default 3, as fgchat bench); PROMPT (512), NEW (128), CTX (8192,
#                  or the largest batch x (PROMPT + NEW) + 256 cells where that is more)
#   KIND           build to bench (default: cuda where built, else cpu)
#   THREADS        llama.cpp's -t / -tb (default: its own choice)
#   JOBS           build parallelism (default nproc)
#   LIBCUDA        the driver library to link (default: libcuda.so.1 as ldconfig finds it)
set -euo pipefail
CALLER_DIR=$PWD  # where relative config.json paths are
cd "$(dirname "$0")/.."
ROOT=$PWD
LCP_VERSION=${LCP_VERSION:-0.3.36}
STORE=$ROOT/.llamacpp
WORK=${LLAMACPP_WORK:-/tmp/llamacpp}
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi

# Paths of vendor/llama.cpp that go into the archive: the build files, ggml with its CPU and CUDA
# backends, libllama, common and the tools that tools/CMakeLists.txt adds (kept as upstream
# ships them, so no CMake file is edited). Left out: model vocab files, docs, tests, examples,
# the web UI/server, Python packages and every other ggml backend.
KEEP=(CMakeLists.txt LICENSE licenses cmake include src common vendor
      ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src
      tools/CMakeLists.txt tools/batched-bench tools/gguf-split tools/imatrix tools/llama-bench
      tools/completion tools/perplexity tools/quantize tools/tokenize tools/tts tools/mtmd
      tools/cvector-generator tools/export-lora tools/fit-params tools/results)
DROP_BACKENDS=(blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan
               webgpu zdnn zendnn)
# llama-quantize's type names for the block formats fgchat runs as they are (engine/quant)
QUANT_TYPES=(Q8_0 Q4_0 Q4_1 Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K)

src_archive() {
  mkdir -p "$STORE"
  local sdist=$STORE/llama_cpp_python-$LCP_VERSION.tar.gz
  if [[ ! -f $sdist ]]; then
    echo "fetching llama-cpp-python $LCP_VERSION sdist"
    "$PY" - "$LCP_VERSION" "$sdist" <<'EOF'
import hashlib, json, os, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
name = f"llama_cpp_python-{version}.tar.gz"
entry = next((f for f in files if f["filename"] == name), None)
if entry is None:
    sys.exit(f"{name} is not on PyPI")
digest = hashlib.sha256()
with urllib.request.urlopen(entry["url"], timeout=600) as r, open(dest + ".part", "wb") as out:
    while chunk := r.read(1 << 20):
        digest.update(chunk)
        out.write(chunk)
if digest.hexdigest() != entry["hashes"]["sha256"]:
    sys.exit(f"{name}: sha256 mismatch")
os.replace(dest + ".part", dest)
print(f"{name}: {os.path.getsize(dest)} bytes, sha256 {digest.hexdigest()}")
EOF
  fi
  local tmp; tmp=$(mktemp -d /tmp/llamacpp-sdist.XXXXXX)
  tar -xzf "$sdist" -C "$tmp"
  local top=$tmp/llama_cpp_python-$LCP_VERSION
  local vend=$top/vendor/llama.cpp
  # the sdist carries the submodule's git dir: its HEAD is the upstream llama.cpp commit
  local commit=unknown
  [[ -f $top/.git/modules/vendor/llama.cpp/HEAD ]] && commit=$(tr -d '\n' < "$top/.git/modules/vendor/llama.cpp/HEAD")
  local stage=$tmp/stage/llama.cpp
  mkdir -p "$stage"
  for p in "${KEEP[@]}"; do
    mkdir -p "$stage/$(dirname "$p")"
    cp -a "$vend/$p" "$stage/$p"
  done
  for b in "${DROP_BACKENDS[@]}"; do rm -rf "$stage/ggml/src/ggml-$b"; done
  printf '%s\n' "$commit" > "$stage/LLAMACPP_COMMIT"
  printf 'llama-cpp-python %s sdist, vendor/llama.cpp at %s\n' "$LCP_VERSION" "$commit" > "$stage/LLAMACPP_SOURCE"
  tar -czf "$STORE/src.tgz" -C "$tmp/stage" llama.cpp
  rm -rf "$tmp"
  local size; size=$(stat -c %s "$STORE/src.tgz")
  echo "llama.cpp commit $commit"
  echo "$STORE/src.tgz: $size bytes ($(( size / 1048576 )) MiB), $(tar -tzf "$STORE/src.tgz" | wc -l) entries"
  if (( size >= 30000000 )); then echo "src.tgz is over 30 MB: trim more" >&2; exit 1; fi
}

wheels() {
  mkdir -p "$STORE/wheels"
  "$PY" -m pip download -q --no-deps --only-binary :all: --platform manylinux2014_x86_64 \
    --python-version 3.12 -d "$STORE/wheels" cmake ninja
  ls -l "$STORE/wheels"
}

need_cmake() {  # cmake on PATH, else the carried wheel installed under $WORK/tools
  if command -v cmake >/dev/null 2>&1; then return; fi
  local whl; whl=$(ls "$STORE"/wheels/cmake-*.whl 2>/dev/null | head -1 || true)
  if [[ -z $whl ]]; then
    echo "no cmake on this machine and no .llamacpp/wheels/cmake-*.whl carried: run" \
         "'bash scripts/llama_cpp.sh wheels' where there is network, and bring .llamacpp/wheels" >&2
    exit 1
  fi
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --target "$WORK/tools" "$STORE"/wheels/*.whl
  export PATH="$WORK/tools/bin:$PATH" PYTHONPATH="$WORK/tools${PYTHONPATH:+:$PYTHONPATH}"
  command -v cmake >/dev/null || { echo "cmake wheel installed but no cmake on PATH" >&2; exit 1; }
}

find_nvcc() {
  local c
  for c in "$(command -v nvcc 2>/dev/null || true)" "${CUDA_HOME:-}/bin/nvcc" \
           "${CUDA_PATH:-}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    [[ -n $c && -x $c ]] && { echo "$c"; return; }
  done
  return 1
}

# ggml-cuda links cuBLAS and the driver library (libcuda). A toolkit assembled from pip wheels
# (as on this project's machines) has neither: cuBLAS then comes from the nvidia-cublas wheel
# that a CUDA torch installs (its headers through a folder of links, the libraries named to CMake
# directly) and libcuda from the driver's libcuda.so.1. Sets CUDA_EXTRA (cmake arguments) and
# writes $WORK/ld-path (directories the binary needs on LD_LIBRARY_PATH, if any).
cuda_libs() {
  local nvcc=$1
  CUDA_EXTRA=()
  : > "$WORK/ld-path"
  if echo '#include <cublas_v2.h>' | "$nvcc" -x cu -E - -o /dev/null 2>/dev/null; then
    echo "cuBLAS: from the CUDA toolkit"
  else
    local found
    found=$(python3 - <<'EOF'
import glob, os, sys
for base in sys.path:
    for header in sorted(glob.glob(os.path.join(base, "nvidia", "*", "include", "cublas_v2.h"))):
        lib = os.path.join(os.path.dirname(os.path.dirname(header)), "lib")
        libs = sorted(glob.glob(os.path.join(lib, "libcublas.so*")))
        lts = sorted(glob.glob(os.path.join(lib, "libcublasLt.so*")))
        if libs and lts:
            print(os.path.dirname(header), libs[-1], lts[-1], lib)
            sys.exit()
EOF
)
    if [[ -z $found ]]; then
      echo "no cuBLAS: neither the CUDA toolkit nor a pip nvidia-cublas (torch's) has cublas_v2.h" >&2
      exit 1
    fi
    local inc lib lt dir
    read -r inc lib lt dir <<< "$found"
    rm -rf "$WORK/cublas-include" && mkdir -p "$WORK/cublas-include"
    ln -s "$inc"/cublas*.h "$WORK/cublas-include/"
    CUDA_EXTRA+=(-DCMAKE_CUDA_FLAGS="-I$WORK/cublas-include" -DCUDA_cublas_LIBRARY="$lib"
                 -DCUDA_cublasLt_LIBRARY="$lt")
    echo "$dir" >> "$WORK/ld-path"
    echo "cuBLAS: pip's, $lib"
  fi
  local drv=${LIBCUDA:-}
  [[ -n $drv ]] || drv=$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}') || true)
  if [[ -z $drv ]]; then
    for drv in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 ""; do
      [[ -z $drv || -e $drv ]] && break
    done
  fi
  if [[ -n $drv ]]; then
    CUDA_EXTRA+=(-DCUDA_cuda_driver_LIBRARY="$drv")
    echo "libcuda: $drv"
  else
    echo "libcuda: no driver library found (the toolkit's stubs, if any, are used)"
  fi
}

build() {
  local kind=${1:-cuda}
  [[ $kind == cpu || $kind == cuda ]] || { echo "build: cpu or cuda, not '$kind'" >&2; exit 2; }
  [[ -f $STORE/src.tgz ]] || { echo "no .llamacpp/src.tgz: run 'bash scripts/llama_cpp.sh source' where there is network" >&2; exit 1; }
  mkdir -p "$WORK"
  local sum; sum=$(sha256sum "$STORE/src.tgz" | cut -c1-16)
  if [[ ! -f $WORK/src/.stamp || $(cat "$WORK/src/.stamp") != "$sum" ]]; then
    rm -rf "$WORK/src" "$WORK"/build-*
    mkdir -p "$WORK/src"
    tar -xzf "$STORE/src.tgz" -C "$WORK/src"
    echo "$sum" > "$WORK/src/.stamp"
  fi
  local src=$WORK/src/llama.cpp bdir=$WORK/build-$kind commit
  commit=$(cat "$src/LLAMACPP_COMMIT")
  need_cmake
  local gen=()
  if ! command -v make >/dev/null 2>&1; then
    command -v ninja >/dev/null 2>&1 || { echo "neither make nor ninja on this machine (bring .llamacpp/wheels)" >&2; exit 1; }
    gen=(-G Ninja)
  fi
  local args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
              -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
              -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
              -DLLAMA_BUILD_COMMIT="${commit:0:7}" -DLLAMA_BUILD_NUMBER=0)
  if [[ $kind == cuda ]]; then
    local nvcc
    if ! nvcc=$(find_nvcc); then
      echo "no nvcc (CUDA toolkit) on this machine: the CUDA build needs it" >&2; exit 1
    fi
    echo "nvcc: $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*'))"
    cuda_libs "$nvcc"
    args+=("${CUDA_EXTRA[@]}")
    # sm_90 only (H100 / H200); the flash-attention kernels as upstream builds them by default
    # (GGML_CUDA_FA on, f16/bf16/q8_0/q4_0 K/V pairs); CUDA graphs on (GGML_CUDA_GRAPHS, the
    # llama.cpp default); NCCL off: one GPU, and it would only be found by chance here
    args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$nvcc"
           -DGGML_CUDA_GRAPHS=ON -DGGML_CUDA_NCCL=OFF)
  else
    args+=(-DGGML_CUDA=OFF)
  fi
  echo "cmake $(cmake --version | head -1 | grep -o '[0-9][0-9.]*'), $(${CXX:-c++} --version | head -1)"
  local t0=$SECONDS
  if [[ ! -f $bdir/Makefile && ! -f $bdir/build.ninja ]]; then  # else: resume that build
    rm -rf "$bdir"
    cmake -S "$src" -B "$bdir" "${gen[@]}" "${args[@]}" > "$WORK/cmake-$kind.log" 2>&1 \
      || { tail -40 "$WORK/cmake-$kind.log"; rm -rf "$bdir"; exit 1; }
    grep -E "Including|CUDA Toolkit found|CMAKE_CUDA_ARCHITECTURES|llama.cpp version" "$WORK/cmake-$kind.log" || true
  fi
  local t1=$SECONDS
  cmake --build "$bdir" --target llama-batched-bench llama-quantize -j "${JOBS:-$(nproc)}" \
    > "$WORK/build-$kind.log" 2>&1 || { tail -40 "$WORK/build-$kind.log"; exit 1; }
  echo "built $bdir/bin/llama-batched-bench and llama-quantize (llama.cpp ${commit:0:10}, $kind):" \
       "configure $((t1 - t0)) s, build $((SECONDS - t1)) s with -j ${JOBS:-$(nproc)}"
}

is_quant_type() {
  local t
  for t in "${QUANT_TYPES[@]}"; do [[ $1 == "$t" ]] && return 0; done
  return 1
}

# the build a command uses: KIND, else cuda where built, else cpu; prints the tool's path
tool_path() {
  local kind=${KIND:-}
  if [[ -z $kind ]]; then
    if [[ -x $WORK/build-cuda/bin/$1 ]]; then kind=cuda; else kind=cpu; fi
  fi
  local bin=$WORK/build-$kind/bin/$1
  [[ -x $bin ]] || { echo "no $bin: run 'bash scripts/llama_cpp.sh build $kind' first" >&2; exit 1; }
  echo "$bin"
}

need_gguf_py() {  # gguf for tools/random_gguf.py: the venv's, else the wheel in .whl (as tools/gpu_run.sh does)
  "$PY" -c "import gguf, numpy" 2>/dev/null && return
  if ls "$ROOT"/.whl/gguf-*.whl >/dev/null 2>&1; then
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$ROOT"/.whl/gguf-*.whl
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -c "import gguf, numpy" || { echo "tools/random_gguf.py needs gguf and numpy: pip install gguf, or put its wheel in .whl" >&2; exit 1; }
}

# a PRESET argument: a preset name as it is, a config.json path (one with a / or ending in .json)
# made absolute, since the script runs from the repository root
preset_arg() {
  if [[ ($1 == */* || $1 == *.json) && $1 != /* ]]; then echo "$CALLER_DIR/$1"; else echo "$1"; fi
}

# a preset's name in file names and rows: the name itself; for a config.json path its file's stem,
# or its folder's name where the file is config.json (tools/random_gguf.py names it the same way)
preset_label() {
  local base; base=$(basename "$1" .json)
  [[ $base == config && $1 == */* ]] && base=$(basename "$(dirname "$1")")
  echo "$base"
}

# $WORK/gguf/LABEL-DTYPE.gguf of random weights (bf16, f16, f32), made once (again where the preset
# is a config.json newer than the file)
random_gguf() {
  local preset=$1 dtype=$2 gguf
  gguf=$WORK/gguf/$(preset_label "$1")-$2.gguf
  if [[ ! -f $gguf || ( -f $preset && $preset -nt $gguf ) ]]; then
    need_gguf_py
    local t0=$SECONDS
    "$PY" tools/random_gguf.py "$preset" --dtype "$dtype" -o "$gguf.part" >&2 || exit 1
    mv "$gguf.part" "$gguf"
    echo "$gguf: $(stat -c %s "$gguf") bytes in $((SECONDS - t0)) s" >&2
  fi
  echo "$gguf"
}

# $WORK/gguf/LABEL-TYPE.gguf: the preset's random bf16 GGUF quantized by llama-quantize, made once
# (again where the preset is a config.json newer than the file)
quantized_gguf() {
  local preset=$1 type=$2 out label
  label=$(preset_label "$1"); out=$WORK/gguf/$label-$2.gguf
  if [[ ! -f $out || ( -f $preset && $preset -nt $out ) ]]; then
    local bin src; bin=$(tool_path llama-quantize); src=$(random_gguf "$preset" bf16)
    local t0=$SECONDS log=$WORK/logs/quantize-$label-$type.log
    "$bin" "$src" "$out.part" "$type" > "$log" 2>&1 || { tail -30 "$log" >&2; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
    echo "$out: $(stat -c %s "$out") bytes ($type of $(basename "$src")) in $((SECONDS - t0)) s" >&2
  fi
  echo "$out"
}

quantize() {
  (( $# )) || { echo "quantize: name one or more presets" >&2; exit 2; }
  local types=${QUANTS:-Q8_0 Q4_K_M} preset type
  for type in $types; do
    is_quant_type "$type" || { echo "quantize: unknown type '$type' (QUANTS: ${QUANT_TYPES[*]})" >&2; exit 2; }
  done
  for preset in "$@"; do
    [[ $preset != *.gguf ]] || { echo "quantize: name presets, not files ($preset)" >&2; exit 2; }
  done
  mkdir -p "$WORK/gguf" "$WORK/logs"
  tool_path llama-quantize > /dev/null
  for preset in "$@"; do
    preset=$(preset_arg "$preset")
    for type in $types; do quantized_gguf "$preset" "$type"; done
  done
}

bench() {
  (( $# )) || { echo "bench: name one or more presets" >&2; exit 2; }
  local dtype
  for dtype in ${DTYPES:-bf16 f16}; do
    [[ $dtype == bf16 || $dtype == f16 || $dtype == f32 ]] || is_quant_type "$dtype" \
      || { echo "bench: unknown dtype '$dtype' (bf16, f16, f32, ${QUANT_TYPES[*]})" >&2; exit 2; }
  done
  local bin; bin=$(tool_path llama-batched-bench)
  local kind; kind=$(basename "$(dirname "$(dirname "$bin")")"); kind=${kind#build-}
  local commit; commit=$(cat "$WORK/src/llama.cpp/LLAMACPP_COMMIT")
  local out=${OUT:-/tmp/llamacpp-out}; mkdir -p "$out" "$WORK/gguf" "$WORK/logs"
  unset GGML_CUDA_DISABLE_GRAPHS  # CUDA graphs stay on (the llama.cpp default)
  if [[ $kind == cuda && -s $WORK/ld-path ]]; then  # pip's cuBLAS (cuda_libs)
    LD_LIBRARY_PATH="$(paste -sd: "$WORK/ld-path")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
  fi
  local batches=${BATCHES:-1,8} repeats=${REPEATS:-3} pp=${PROMPT:-512} tg=${NEW:-128}
  # the largest batch's sequences share one cache of ctx cells: 8 x (1000 + 32) no longer fit 8192
  local most=$(tr ',' '\n' <<< "$batches" | sort -n | tail -1) ctx=${CTX:-}
  [[ -n $ctx ]] || ctx=$(( most * (pp + tg) + 256 > 8192 ? most * (pp + tg) + 256 : 8192 ))
  # one warm-up run per batch size, then REPEATS timed ones: -npl 1,8,1,8,1,8,1,8
  local npl=$batches i
  for ((i = 0; i < repeats; i++)); do npl+=",$batches"; done
  [[ $kind == cuda ]] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  local preset
  local threads=()
  [[ -n ${THREADS:-} ]] && threads=(-t "$THREADS" -tb "$THREADS")
  for preset in "$@"; do
    local dtypes=${DTYPES:-bf16 f16} label
    [[ $preset == *.gguf ]] && dtypes=file  # a GGUF file as it is (e.g. a quantized model)
    [[ $preset == *.gguf ]] || preset=$(preset_arg "$preset")
    label=$(preset_label "$preset")
    for dtype in $dtypes; do
      local gguf log=$WORK/logs/$label-$dtype.log
      if [[ $dtype == file ]]; then
        gguf=$preset; log=$WORK/logs/$(basename "$preset").log
      elif is_quant_type "$dtype"; then
        gguf=$(quantized_gguf "$preset" "$dtype")
      else
        gguf=$(random_gguf "$preset" "$dtype")
      fi
      local cmd=("$bin" -m "$gguf" -c "$ctx" -b 2048 -ub 512 -npp "$pp" -ntg "$tg" -npl "$npl"
                 -ngl 99 -fa on "${threads[@]}" --output-format jsonl)
      echo "+ ${cmd[*]}" | tee "$log"
      local t0=$SECONDS
      "${cmd[@]}" >> "$log" 2>&1 || { tail -30 "$log"; cat "$log" >> "$out/llamacpp.log"; exit 1; }
      cat "$log" >> "$out/llamacpp.log"
      echo "llama-batched-bench $label $dtype: $((SECONDS - t0)) s (log $log, appended to $out/llamacpp.log)"
      "$PY" - "$log" "$out/llamacpp.json" "$label" "$dtype" "$commit" "$kind" \
             "$batches" "$repeats" <<'EOF'
import json, statistics, sys
log, dest, preset, dtype, commit, kind, batches, repeats = sys.argv[1:]
runs = [json.loads(line) for line in open(log) if line.startswith('{"n_kv_max"')]
batch_sizes = [int(b) for b in batches.split(",")]
rows = []
for b in batch_sizes:
    mine = [r for r in runs if r["pl"] == b][1:]  # the first one is the warm-up
    if len(mine) != int(repeats):
        sys.exit(f"{log}: {len(mine)} timed runs at batch {b}, expected {repeats}")
    # T_TG is tg decode steps, each one token for each of the pl sequences: ms per step is
    # 1000 * T_TG / tg (= 1000 / S_TG * pl). T_PP is the prefill of all pl prompts.
    tpot = [1000.0 * r["t_tg"] / r["tg"] for r in mine]
    ttft = [1000.0 * r["t_pp"] for r in mine]
    rows.append({"runner": "llama.cpp", "preset": preset, "batch_size": b, "dtype": dtype,
                 "tpot_ms": statistics.median(tpot), "ttft_ms": statistics.median(ttft),
                 "tpot_ms_runs": tpot, "ttft_ms_runs": ttft,
                 "output_tokens_per_s": statistics.median(r["speed_tg"] for r in mine),
                 "prompt_len": mine[0]["pp"], "output_len": mine[0]["tg"],
                 "flash_attn": mine[0]["flash_attn"], "n_gpu_layers": mine[0]["n_gpu_layers"],
                 "backend": kind, "commit": commit})
# one file for every preset and dtype ($OUT brings back few files): rows of this run replace
# earlier rows of the same preset, dtype, batch size and backend
try:
    old = json.load(open(dest))
except (OSError, ValueError):
    old = []
key = lambda r: (r.get("preset"), r.get("dtype"), r.get("batch_size"), r.get("backend"))
new = {key(r) for r in rows}
json.dump([r for r in old if key(r) not in new] + rows, open(dest, "w"), indent=1)
print(f"| runner | preset | dtype | batch | TTFT ms | TPOT ms (ms/step) | tok/s | runs |")
for r in rows:
    print(f"| llama.cpp {r['commit'][:7]} ({r['backend']}) | {preset} | {dtype} | {r['batch_size']} | "
          f"{r['ttft_ms']:.2f} | {r['tpot_ms']:.3f} | {r['output_tokens_per_s']:.0f} | "
          f"{', '.join(f'{t:.3f}' for t in r['tpot_ms_runs'])} |")
for r in rows:
    print(json.dumps({k: r[k] for k in ("runner", "preset", "batch_size", "tpot_ms", "ttft_ms", "commit")}))
print(f"-> {dest}")
EOF
    done
  done
}

case ${1:-} in
  source) src_archive ;;
  wheels) wheels ;;
  build) shift; build "$@" ;;
  quantize) shift; quantize "$@" ;;
  bench) shift; bench "$@" ;;
  *) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0" >&2; exit 2 ;;
esac
