#!/usr/bin/env bash
# One H200 call on real weights and presets: run after scripts/gpu_weights.sh has put the GGUF
# parts on the machine (see that script). Results land in $OUT.
# Usage: bash scripts/gpu_check.sh SECTION...   sections:
#   diag     where a bf16 prefill leaves float32 (scripts/diagnose_prefill.py), bf16 and fp16
#   tests    every GPU test (pytest -m gpu), real weights included; tests-real: only those and outliers
#   table    the README's Correctness table (scripts/check_real_weights.py)
#   bench    fgchat bench on the embedded model and the presets; with .old/ carried (an older
#            fgchat package, e.g. `git archive <sha> fgchat | tar -x -C .old`), the same runs of
#            it alternate with this tree's, process by process
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fgchat-out}; mkdir -p "$OUT"
JSON=/tmp/fgchat-json; mkdir -p $JSON  # packed into $OUT/json.tgz at the end (8 files come back)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" FGCHAT_CACHE_DIR=/tmp/fgchat-cache
GGUF=$(bash scripts/gpu_weights.sh join) || { echo "no real weights: run scripts/gpu_weights.sh put first"; exit 1; }
export FGCHAT_REAL_GGUF=$GGUF
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/run.log"
echo "commit ${FGCHAT_COMMIT:-unknown} (FGCHAT_COMMIT: the device copy's git metadata may be stale)" | tee -a "$OUT/run.log"
bench() {  # tree (new|old), name, args...
  local tree=$1 name=$2; shift 2
  local pp=$PYTHONPATH; [[ $tree == old ]] && pp="$PWD/.old:/tmp/site"
  PYTHONPATH=$pp timeout "${BENCH_TIMEOUT:-240}" python3 -m fgchat.cli bench --no-progress \
    --json "$JSON/bench_${tree}_$name.json" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -E "^(│|\||fgchat|startup)" | tail -14
}
for what in "$@"; do
  case $what in
    diag)
      for dt in bfloat16 float16; do
        timeout 300 python3 scripts/diagnose_prefill.py --model "$GGUF" --dtype $dt 2>&1 | tee -a "$OUT/diag.log"
      done ;;
    tests)  # every GPU test
      timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 300 -W ignore \
        --ignore-glob='tests/test_tui*' tests 2>&1 | tee "$OUT/tests.log" | tail -25 ;;  # no textual there
    tests-real)  # the real-weight and outlier tests only
      timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 300 -W ignore \
        tests/test_gpu_outliers.py tests/test_gpu_real_weights.py 2>&1 | tee "$OUT/tests-real.log" | tail -25 ;;
    table)
      timeout 400 python3 scripts/check_real_weights.py --model "$GGUF" --json "$JSON/correctness.json" 2>&1 \
        | grep -v Loading | tee "$OUT/correctness.log" | tail -30 ;;
    bench)
      trees=(new); [[ -d .old/fgchat ]] && trees=(old new old new)
      i=0
      for tree in "${trees[@]}"; do
        i=$((i + 1))
        bench $tree "embedded-$i" --model "$GGUF" --batch-sizes 1,8 --repeats 2
        bench $tree "1b-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
        bench $tree "135m-$i" --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2 --modes piecewise,full
      done
      bench new 8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes full ;;
    *) echo "unknown section $what" ;;
  esac
done
tar czf "$OUT/json.tgz" -C "$JSON" . 2>/dev/null
