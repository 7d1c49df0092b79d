#!/usr/bin/env bash
# One H200 call: GPU tests, attention micro-benchmark and the model benchmarks. Results land in $OUT.
# Usage (device tool, carry .whl): bash scripts/gpu_run.sh [tests|attn|bench|all]
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fgchat-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 420 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_graphs.py -q --timeout 300 -W ignore 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ $what == attn || $what == all ]]; then
  timeout 120 python3 scripts/bench_attention.py 2>&1 | tee "$OUT/attn_bench.log" | tail -30
fi
if [[ $what == bench || $what == all ]]; then
  timeout 400 python3 -m fgchat.cli bench --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2 --no-progress --json "$OUT/bench_llama-3.2-1b.json" 2>&1 | tee "$OUT/bench.log" | tail -25
fi
