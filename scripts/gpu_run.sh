#!/usr/bin/env bash
# One H200 call: GPU tests and the model benchmarks. Results land in $OUT.
# Usage (device tool, carry .whl): FGCHAT_COMMIT=<sha> bash scripts/gpu_run.sh [tests|bench|more|tui|peers|all|probe|run3|run4|final3|pdl|split|verify|final4|gputests|final5|sweep|s5|s5b|final6|s5c|s5d|s6a|s6b|s6c|final7|final7p|s6d|s6f|s7a|s7b|s7d|s7e|s8|s9|s10|s11|s12|s13|s14]
# The README's H200 section: s9 (GPU tests, the current-row A/B) then s10 (modes side by side,
# larger models, peers, variants, a host profile of eager); s8 is session 8's; s7d/s7e are the session-7 equivalents (s7e adds an MLP tile sweep); gputests runs every GPU test;
# s6a-s6c measured the L2 prefetch and the attention boundary (timeline_step.py); sweep the projection tiles.
# Older sections produced the other folders of docs/bench and the notes.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fgchat-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/run.log"
if [[ $what == tests || $what == all || $what == final || $what == final2 ]]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_fused.py tests/test_gpu_graphs.py \
    -q --timeout 300 -W ignore 2>&1 | tee -a "$OUT/run.log" | tail -30
fi
bench() {  # name, extra args...
  local name=$1; shift
  timeout "${BENCH_TIMEOUT:-300}" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$name.json" "$@" 2>&1 \
    | tee -a "$OUT/run.log" | tail -12
}
if [[ $what == bench || $what == all ]]; then
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
  FGCHAT_FUSED=0 bench llama-3.2-1b-unfused --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2 --modes full
fi
if [[ $what == more || $what == all ]]; then
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes eager,full
fi
if [[ $what == tui || $what == all ]]; then
  timeout 240 python3 scripts/tui_vs_headless.py full 2>&1 | tail -5 | tee -a "$OUT/run.log"
fi
if [[ $what == final ]]; then
  BENCH_TIMEOUT=120 bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 \
    --peers hf-eager
  timeout 100 python3 scripts/tui_vs_headless.py full 2>&1 | tail -5 | tee -a "$OUT/run.log"
fi
if [[ $what == final2 ]]; then
  timeout 75 python3 scripts/tui_vs_headless.py full 2>&1 | tail -5 | tee -a "$OUT/run.log"
fi
if [[ $what == probe ]]; then
  timeout 120 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_fused.py -q --timeout 100 -W ignore \
    2>&1 | tail -15 | tee -a "$OUT/run.log"
  timeout 170 python3 scripts/bench_proj.py --sweep 2>&1 | tee -a "$OUT/run.log"
  BENCH_TIMEOUT=70 bench 1b-gemv --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  FGCHAT_GEMV=0 BENCH_TIMEOUT=70 bench 1b-cublas --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2 --modes full
  BENCH_TIMEOUT=60 bench 135m-gemv --preset smollm2-135m --random-weights --batch-sizes 1 --repeats 2 --modes full
  timeout 60 python3 scripts/profile_step.py llama-3.2-1b 2>&1 | tee -a "$OUT/run.log"
fi
if [[ $what == run3 ]]; then
  export BENCH_TIMEOUT=80
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
  FGCHAT_PIPELINE=0 bench 1b-no-pipeline --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  FGCHAT_GEMV=0 bench 1b-no-gemv --preset llama-3.2-1b --random-weights --batch-sizes 1 --repeats 2 --modes full
  FGCHAT_FAST_LAUNCH=0 bench 1b-plain-launch --preset llama-3.2-1b --random-weights --batch-sizes 1 --repeats 2 \
    --modes eager,piecewise
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes eager,full
  timeout 30 python3 scripts/bench_launch.py 2>&1 | tail -8 | tee -a "$OUT/run.log"
  [[ -f scripts/profile_prefill.py ]] && timeout 50 python3 scripts/profile_prefill.py 2>&1 | tail -30 | tee -a "$OUT/run.log"
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -p no:cacheprovider -m gpu tests/test_launch.py tests/test_gpu_fused.py \
    tests/test_gpu_graphs.py tests/test_gpu_prefill.py -q --timeout 120 -W ignore 2>&1 | tee -a "$OUT/run.log" | tail -25
fi
if [[ $what == run4 ]]; then
  export BENCH_TIMEOUT=80
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
  FGCHAT_FUSED_COMBINE=0 bench 1b-separate-combine --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2 --modes full
  FGCHAT_ROPE_IN_ATTENTION=0 bench 1b-separate-rope --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2
  FGCHAT_ROPE_IN_ATTENTION=0 bench 135m-separate-rope --preset smollm2-135m --random-weights --batch-sizes 1 \
    --repeats 2 --modes full
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes eager,full
  timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_attention.py tests/test_launch.py \
    tests/test_gpu_fused.py tests/test_gpu_graphs.py tests/test_gpu_prefill.py -q --timeout 100 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -12
  timeout 90 python3 scripts/bench_proj.py --sweep 2>&1 | tee -a "$OUT/run.log" | grep -v skip
  BENCH_TIMEOUT=300 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2 --modes full --peers hf --peer-timeout 240
fi
if [[ $what == final3 ]]; then
  export BENCH_TIMEOUT=90
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 3 --modes eager,full
  FGCHAT_ROPE_IN_ATTENTION=0 bench 1b-separate-rope --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full
  FGCHAT_FUSED_COMBINE=1 bench 1b-fused-combine --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full
  FGCHAT_ROPE_IN_ATTENTION=0 bench 135m-separate-rope --preset smollm2-135m --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full
  BENCH_TIMEOUT=200 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 150
  timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_attention.py tests/test_launch.py \
    tests/test_gpu_fused.py tests/test_gpu_graphs.py tests/test_gpu_prefill.py -q --timeout 100 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -8
  timeout 40 python3 scripts/profile_step.py llama-3.2-1b 2>&1 | tee -a "$OUT/run.log" | tail -34
fi
if [[ $what == pdl ]]; then
  export BENCH_TIMEOUT=80
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
  FGCHAT_PDL=0 bench 1b-no-pdl --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  FGCHAT_LM_HEAD_GEMV=0 bench 1b-cublas-head --preset llama-3.2-1b --random-weights --batch-sizes 1 --repeats 2 \
    --modes full
  FGCHAT_GEMV_MAX=1e12 bench 1b-all-gemv --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 \
    --modes full
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  FGCHAT_PDL=0 bench 135m-no-pdl --preset smollm2-135m --random-weights --batch-sizes 1 --repeats 2 --modes full
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  FGCHAT_PDL=0 bench 8b-no-pdl --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_pdl.py tests/test_attention.py \
    tests/test_gpu_fused.py tests/test_gpu_graphs.py tests/test_gpu_prefill.py -q --timeout 100 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -15
  timeout 40 python3 scripts/profile_host.py 2>&1 | tee -a "$OUT/run.log" | head -45
  timeout 80 python3 scripts/bench_proj.py --pdl 2>&1 | tee -a "$OUT/run.log"
fi
if [[ $what == split ]]; then
  export BENCH_TIMEOUT=80
  timeout 170 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_pdl.py tests/test_attention.py tests/test_launch.py \
    tests/test_gpu_fused.py tests/test_gpu_graphs.py tests/test_gpu_prefill.py -q --timeout 100 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -15
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
  FGCHAT_SPLIT_K=0 bench 1b-no-split --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  FGCHAT_GEMV_MAX_SPLIT=1e12 bench 1b-split-down --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 \
    --modes full
  FGCHAT_PDL_AFTER_LIBRARY=1 bench 1b-pdl-all --preset llama-3.2-1b --random-weights --batch-sizes 1 --repeats 2 --modes full
  FGCHAT_PDL=0 bench 1b-no-pdl --preset llama-3.2-1b --random-weights --batch-sizes 1 --repeats 2 --modes full
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  FGCHAT_PDL_AFTER_LIBRARY=1 bench 8b-pdl-all --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  FGCHAT_GEMV_MAX_SPLIT=1e12 bench 8b-split --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  FGCHAT_PDL=0 bench 8b-no-pdl --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  timeout 80 python3 scripts/bench_proj.py --pdl 2>&1 | tee -a "$OUT/run.log"
fi
GPU_TESTS="tests/test_gpu_l2_prefetch.py tests/test_gpu_pdl.py tests/test_gpu_prefill_graphs.py tests/test_attention.py tests/test_launch.py
  tests/test_gpu_fused.py tests/test_gpu_graphs.py tests/test_gpu_prefill.py"
if [[ $what == verify ]]; then
  export BENCH_TIMEOUT=80
  timeout 240 python3 -m pytest -p no:cacheprovider -m gpu $GPU_TESTS -q --timeout 120 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -25
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2 --modes full
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
fi
if [[ $what == final4 ]]; then  # the README run
  export BENCH_TIMEOUT=100
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  BENCH_TIMEOUT=230 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 170
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 3 --modes eager,full
  export BENCH_TIMEOUT=60
  for v in FGCHAT_PDL=0 FGCHAT_PDL_AFTER_LIBRARY=0 FGCHAT_SPLIT_K=0 FGCHAT_GEMV_MAX_SPLIT=4194304 \
      FGCHAT_PREFILL_GRAPHS=0; do
    timeout "$BENCH_TIMEOUT" env "$v" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_1b-${v,,}.json" --preset llama-3.2-1b \
      --random-weights --batch-sizes 1,8 --repeats 3 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -4
  done
fi
if [[ $what == final5 ]]; then  # GPU tests, then the README run (final4)
  bash "$0" gputests
  bash "$0" final4
fi
if [[ $what == sweep ]]; then  # tiles of our projection kernel at the large shapes (session 5)
  timeout "${SWEEP_TIMEOUT:-420}" python3 scripts/sweep_proj.py --json "$OUT/sweep.json" --models "${SWEEP_MODELS:-1b,8b,135m}" \
    2>&1 | tee -a "$OUT/run.log" | grep -v skip
fi
if [[ $what == s5 ]]; then  # session 5: GPU tests, then gate/up+SiLU and tile variants end to end, then the sweep
  bash "$0" gputests
  v1b() {  # name, env...: Llama-3.2-1B full at batch 1 and 8
    local name=$1; shift
    timeout 60 env "$@" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_1b-$name.json" --preset llama-3.2-1b \
      --random-weights --batch-sizes 1,8 --repeats 2 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -3
  }
  v1b default FGCHAT_X=0
  v1b no-glu FGCHAT_GLU=0
  v1b qkv-ours FGCHAT_PROJ_CONFIGS="qkv=32,256,4,4"
  v1b down-ours FGCHAT_PROJ_CONFIGS="down=32,256,4,4"
  v1b qkv-down-ours FGCHAT_PROJ_CONFIGS="qkv=32,256,4,4;down=32,256,4,4"
  v1b glu-plain-tile FGCHAT_PROJ_CONFIGS="gate_up=64,256,4,3"
  v1b no-prefill-graphs FGCHAT_PREFILL_GRAPHS=0
  v1b default-again FGCHAT_X=0
  for v in "default FGCHAT_X=0" "no-glu FGCHAT_GLU=0" "qkv-ours FGCHAT_PROJ_CONFIGS=qkv=64,256,4,3,1" \
      "down-ours FGCHAT_PROJ_CONFIGS=down=64,256,4,3,1"; do
    set -- $v
    timeout 80 env "$2" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_8b-$1.json" --preset llama-3.1-8b \
      --random-weights --batch-sizes 1 --repeats 2 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -3
  done
  for v in "default FGCHAT_X=0" "no-glu FGCHAT_GLU=0"; do
    set -- $v
    timeout 60 env "$2" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_135m-$1.json" --preset smollm2-135m \
      --random-weights --batch-sizes 1,8 --repeats 2 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -3
  done
  SWEEP_MODELS=1b,8b SWEEP_TIMEOUT=220 bash "$0" sweep
fi
if [[ $what == s5b ]]; then  # session 5: prefill-graph pool and tile routes end to end
  v() {  # preset tag name batch-sizes env...
    local preset=$1 tag=$2 name=$3 bs=$4; shift 4
    timeout 80 env "$@" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$tag-$name.json" --preset "$preset" \
      --random-weights --batch-sizes "$bs" --repeats 2 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -2
  }
  v llama-3.2-1b 1b default 1,8 FGCHAT_X=0
  v llama-3.2-1b 1b no-prefill-graphs 1,8 FGCHAT_PREFILL_GRAPHS=0
  v llama-3.2-1b 1b prefill-own-pool 1,8 FGCHAT_PREFILL_OWN_POOL=1
  v llama-3.2-1b 1b qkv-ours 1,8 FGCHAT_PROJ_CONFIGS="qkv=32,256,4,4"
  v llama-3.2-1b 1b default-again 1,8 FGCHAT_X=0
  v llama-3.1-8b 8b default 1 FGCHAT_X=0
  v llama-3.1-8b 8b no-glu 1 FGCHAT_GLU=0
  v llama-3.1-8b 8b qkv-ours 1 FGCHAT_PROJ_CONFIGS="qkv=64,256,4,3,1"
  v llama-3.1-8b 8b down-ours 1 FGCHAT_PROJ_CONFIGS="down=64,256,4,3,1"
  v llama-3.1-8b 8b o-ours 1 FGCHAT_SPLIT_MAX_N=4096 FGCHAT_PROJ_CONFIGS="o=64,256,4,3,1"
  v llama-3.1-8b 8b all-ours 1 FGCHAT_SPLIT_MAX_N=4096 \
    FGCHAT_PROJ_CONFIGS="qkv=64,256,4,3,1;o=64,256,4,3,1;down=64,256,4,3,1"
fi
if [[ $what == final6 ]]; then  # session 5: GPU tests, then the README run and its variants
  bash "$0" gputests
  export BENCH_TIMEOUT=100
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 3 --modes eager,full
  for v in "1b FGCHAT_GLU=0" "1b FGCHAT_PREFILL_GRAPHS=0" "8b FGCHAT_GEMV_BIG=0" "8b FGCHAT_GLU=0"; do
    set -- $v
    preset=llama-3.2-1b bs=1,8; [[ $1 == 8b ]] && preset=llama-3.1-8b bs=1
    timeout 80 env "$2" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$1-${2,,}.json" --preset $preset \
      --random-weights --batch-sizes $bs --repeats 3 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -2
  done
  BENCH_TIMEOUT=230 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 170
fi
if [[ $what == s5c ]]; then  # session 5: why decode is faster without prefill graphs
  for v in default:FGCHAT_X=0 off:FGCHAT_PREFILL_GRAPHS=0 no-replay:FGCHAT_PREFILL_REPLAY=0 \
      first:FGCHAT_PREFILL_FIRST=1 default-again:FGCHAT_X=0 off-again:FGCHAT_PREFILL_GRAPHS=0; do
    timeout 60 env "${v#*:}" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_1b-${v%%:*}.json" \
      --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -2
  done
fi
if [[ $what == s5d ]]; then  # session 5: prefill graphs captured first (the new default), tests and side by side
  timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_prefill_graphs.py tests/test_gpu_graphs.py \
    -q --timeout 120 -W ignore 2>&1 | tee -a "$OUT/run.log" | tail -4
  for m in llama-3.2-1b smollm2-135m llama-3.1-8b; do
    for v in first:FGCHAT_X=0 after:FGCHAT_PREFILL_FIRST=0; do
      timeout 60 env "${v#*:}" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$m-${v%%:*}.json" \
        --preset $m --random-weights --batch-sizes 1 --repeats 2 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -1
    done
  done
fi
if [[ $what == s6a ]]; then  # session 6: L2 weight prefetch beside attention (full graphs only)
  timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_l2_prefetch.py tests/test_gpu_graphs.py \
    -q --timeout 120 -W ignore 2>&1 | tee -a "$OUT/run.log" | tail -4
  v() {  # preset tag name batch-sizes modes env...
    local preset=$1 tag=$2 name=$3 bs=$4 modes=$5; shift 5
    timeout 80 env "$@" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$tag-$name.json" --preset "$preset" \
      --random-weights --batch-sizes "$bs" --repeats 3 --modes "$modes" 2>&1 | tee -a "$OUT/run.log" | tail -2
  }
  v llama-3.2-1b 1b pf16 1,8 piecewise,full FGCHAT_L2_PREFETCH_MB=16
  v llama-3.2-1b 1b pf0 1,8 piecewise,full FGCHAT_L2_PREFETCH_MB=0
  v llama-3.2-1b 1b pf8 1,8 full FGCHAT_L2_PREFETCH_MB=8
  v llama-3.2-1b 1b pf32 1,8 full FGCHAT_L2_PREFETCH_MB=32
  v llama-3.2-1b 1b pf16-again 1,8 full FGCHAT_L2_PREFETCH_MB=16
  v llama-3.2-1b 1b pf0-again 1,8 full FGCHAT_L2_PREFETCH_MB=0
  v smollm2-135m 135m pf16 1 full FGCHAT_L2_PREFETCH_MB=16
  v smollm2-135m 135m pf0 1 full FGCHAT_L2_PREFETCH_MB=0
  v llama-3.1-8b 8b pf16 1 full FGCHAT_L2_PREFETCH_MB=16
  v llama-3.1-8b 8b pf0 1 full FGCHAT_L2_PREFETCH_MB=0
  v llama-3.1-8b 8b pf48 1 full FGCHAT_L2_PREFETCH_MB=48
fi
if [[ $what == s6b ]]; then  # session 6: kernel timelines; whole-tensor L2 prefetch plans
  timeout 100 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_l2_prefetch.py -q --timeout 90 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -4
  FGCHAT_L2_PREFETCH_MB=0 timeout 90 python3 scripts/timeline_step.py llama-3.2-1b full,piecewise 1 2>&1 | tee -a "$OUT/run.log"
  FGCHAT_L2_PREFETCH_MB=0 FGCHAT_PROJ_CONFIGS="qkv=32,256,4,4" timeout 60 python3 scripts/timeline_step.py llama-3.2-1b full 1 \
    2>&1 | tee -a "$OUT/run.log"
  v() {  # preset tag name batch-sizes modes env...
    local preset=$1 tag=$2 name=$3 bs=$4 modes=$5; shift 5
    timeout 80 env "$@" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$tag-$name.json" --preset "$preset" \
      --random-weights --batch-sizes "$bs" --repeats 3 --modes "$modes" 2>&1 | tee -a "$OUT/run.log" | tail -2
  }
  v smollm2-135m 135m pf16 1,8 full FGCHAT_L2_PREFETCH_MB=16
  v smollm2-135m 135m pf0 1,8 full FGCHAT_L2_PREFETCH_MB=0
  v llama-3.2-1b 1b pf16 1,8 full FGCHAT_L2_PREFETCH_MB=16
  v llama-3.2-1b 1b pf0 1,8 full FGCHAT_L2_PREFETCH_MB=0
  v llama-3.2-1b 1b qkv-ours 1,8 piecewise,full FGCHAT_L2_PREFETCH_MB=0 FGCHAT_PROJ_CONFIGS="qkv=32,256,4,4"
fi
if [[ $what == s6c ]]; then  # session 6: the attention boundary in full graphs (combine, o prefetch)
  timeout 60 python3 scripts/timeline_step.py llama-3.2-1b full 1 2>&1 | tee -a "$OUT/run.log"
  FGCHAT_PDL_AFTER_ATTENTION=0 timeout 60 python3 scripts/timeline_step.py llama-3.2-1b full 1 2>&1 | tee -a "$OUT/run.log"
  FGCHAT_FUSED_COMBINE=1 timeout 60 python3 scripts/timeline_step.py llama-3.2-1b full 1 2>&1 | tee -a "$OUT/run.log"
  v() {  # preset tag name batch-sizes modes env...
    local preset=$1 tag=$2 name=$3 bs=$4 modes=$5; shift 5
    timeout 80 env "$@" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$tag-$name.json" --preset "$preset" \
      --random-weights --batch-sizes "$bs" --repeats 3 --modes "$modes" 2>&1 | tee -a "$OUT/run.log" | tail -2
  }
  v llama-3.2-1b 1b default 1,8 piecewise,full FGCHAT_X=0
  v llama-3.2-1b 1b fused-combine 1,8 piecewise,full FGCHAT_FUSED_COMBINE=1
  v llama-3.2-1b 1b pf0 1,8 full FGCHAT_L2_PREFETCH_MB=0
  v llama-3.2-1b 1b o-waits 1,8 full FGCHAT_PDL_AFTER_ATTENTION=0
  v llama-3.2-1b 1b o-waits-pf0 1,8 full FGCHAT_PDL_AFTER_ATTENTION=0 FGCHAT_L2_PREFETCH_MB=0
  v llama-3.2-1b 1b default-again 1,8 full FGCHAT_X=0
  v llama-3.1-8b 8b default 1 full FGCHAT_X=0
  v llama-3.1-8b 8b pf40 1 full FGCHAT_L2_PREFETCH_MB=40
fi
if [[ $what == final7 ]]; then  # session 6: GPU tests, then the README run and its variants (peers: final7p)
  bash "$0" gputests
  export BENCH_TIMEOUT=100
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 3 --modes eager,full
  bench qwen2.5-1.5b --preset qwen2.5-1.5b --random-weights --batch-sizes 1,8 --repeats 3 --modes full
  for v in "1b FGCHAT_L2_PREFETCH_MB=0" "1b FGCHAT_PREFILL_FIRST=0" "135m FGCHAT_L2_PREFETCH_MB=0"; do
    set -- $v
    preset=llama-3.2-1b; [[ $1 == 135m ]] && preset=smollm2-135m
    timeout 80 env "$2" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_$1-${2,,}.json" --preset $preset \
      --random-weights --batch-sizes 1,8 --repeats 3 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -2
  done
fi
if [[ $what == final7p ]]; then
  BENCH_TIMEOUT=260 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 190
fi
if [[ $what == s6d ]]; then  # session 6: host launch time per step; prefill pool measured after emptying the cache
  timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_prefill_graphs.py tests/test_gpu_l2_prefetch.py \
    tests/test_gpu_graphs.py -q --timeout 120 -W ignore 2>&1 | tee -a "$OUT/run.log" | tail -4
  export BENCH_TIMEOUT=100
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.2-1b-again --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes piecewise,full
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
fi
if [[ $what == s6f ]]; then  # session 6: every GPU test at HEAD, then 1B modes side by side
  bash "$0" gputests
  BENCH_TIMEOUT=100 bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
fi
if [[ $what == gputests ]]; then
  timeout 280 python3 -m pytest -p no:cacheprovider -m gpu $GPU_TESTS -q --timeout 120 -W ignore 2>&1 \
    | tee -a "$OUT/run.log" | tail -25
fi
if [[ $what == peers || $what == all ]]; then
  BENCH_TIMEOUT=240 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 2 --modes full --peers hf
fi
if [[ $what == s7a ]]; then  # session 7: GPU tests at HEAD; attention K/V preload; qkv tiles on the H200
  bash "$0" gputests
  FGCHAT_ATTN_PRELOAD=1 timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_graphs.py \
    tests/test_gpu_pdl.py -q --timeout 120 -W ignore 2>&1 | tee -a "$OUT/run.log" | tail -4
  export BENCH_TIMEOUT=100
  one() { bench "$@" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes full; }
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  FGCHAT_ATTN_PRELOAD=1 bench 1b-preload --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 \
    --modes piecewise,full
  timeout 150 python3 scripts/sweep_proj.py --models 1b --roles qkv --json "$OUT/sweep_qkv.json" 2>&1 | tee -a "$OUT/run.log"
  QKV=$(python3 -c "import json; print(json.load(open('$OUT/sweep_qkv.json'))['1b/qkv/plain']['1']['tile'])")
  echo "qkv tile: $QKV" | tee -a "$OUT/run.log"
  FGCHAT_ATTN_PRELOAD=1 FGCHAT_PROJ_CONFIGS="qkv=$QKV" one 1b-preload-qkv
  FGCHAT_PROJ_CONFIGS="qkv=$QKV" one 1b-qkv
  one 1b-default-again
  FGCHAT_ATTN_PRELOAD=1 one 1b-preload-again
  for p in 0 1; do
    FGCHAT_ATTN_PRELOAD=$p BENCH_TIMEOUT=60 bench 135m-preload$p --preset smollm2-135m --random-weights --batch-sizes 1 \
      --repeats 3 --modes full
  done
  timeout 90 python3 scripts/timeline_step.py llama-3.2-1b full 1 2>&1 | tee -a "$OUT/run.log" | head -30
  FGCHAT_ATTN_PRELOAD=1 timeout 90 python3 scripts/timeline_step.py llama-3.2-1b full 1 2>&1 | tee -a "$OUT/run.log" | head -30
fi
if [[ $what == s7b ]]; then  # session 7: GPU tests; preload + qkv on ours + device advance by default, vs without
  bash "$0" gputests
  export BENCH_TIMEOUT=100
  b1() { local name=$1; shift; bench "$name" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 "$@"; }
  b1 llama-3.2-1b
  FGCHAT_ATTN_PRELOAD=0 FGCHAT_QKV_GEMV=0 FGCHAT_DEVICE_ADVANCE=0 b1 1b-s6-defaults --modes full
  FGCHAT_DEVICE_ADVANCE=0 b1 1b-no-advance --modes full
  b1 1b-again --modes piecewise,full
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes eager,full
  FGCHAT_ATTN_PRELOAD=0 bench 8b-no-preload --preset llama-3.1-8b --random-weights --batch-sizes 1 --repeats 2 --modes full
  timeout 90 python3 scripts/timeline_step.py llama-3.2-1b full 1 2>&1 | tee -a "$OUT/run.log" | head -30
fi
readme_presets() {  # the README's H200 table: 1B in every mode (twice), the other presets
  bench llama-3.2-1b --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.2-1b-again --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes piecewise,full
  bench smollm2-135m --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3
  bench llama-3.1-8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes eager,full
  bench qwen2.5-1.5b --preset qwen2.5-1.5b --random-weights --batch-sizes 1,8 --repeats 3 --modes full
}
if [[ $what == s7d ]]; then  # session 7 README run: GPU tests, modes side by side, larger models, variants
  bash "$0" gputests
  export BENCH_TIMEOUT=100
  readme_presets
  for v in FGCHAT_ATTN_PRELOAD=0 FGCHAT_QKV_GEMV=0 FGCHAT_DEVICE_ADVANCE=0 FGCHAT_L2_PREFETCH_MB=0; do
    timeout 80 env "$v" python3 -m fgchat.cli bench --no-progress --json "$OUT/bench_1b-${v,,}.json" \
      --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes full 2>&1 | tee -a "$OUT/run.log" | tail -2
  done
fi
if [[ $what == s7e ]]; then  # session 7: peers in one process, then down and gate/up tiles (sweep, then in the step)
  BENCH_TIMEOUT=260 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 190
  timeout 150 python3 scripts/sweep_proj.py --models 1b --roles down,gate_up --json "$OUT/sweep_mlp.json" 2>&1 \
    | tee -a "$OUT/run.log"
  DOWN=$(python3 -c "import json; print(json.load(open('$OUT/sweep_mlp.json'))['1b/down/split2']['1']['tile'])")
  GU=$(python3 -c "import json; print(json.load(open('$OUT/sweep_mlp.json'))['1b/gate_up/glu']['1']['tile'])")
  echo "down tile: $DOWN  gate_up tile: $GU" | tee -a "$OUT/run.log"
  b1() { local name=$1; shift; BENCH_TIMEOUT=60 bench "$name" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes full; }
  b1 1b-default
  FGCHAT_PROJ_CONFIGS="down=$DOWN" b1 1b-down
  FGCHAT_PROJ_CONFIGS="gate_up=$GU" b1 1b-gate-up
fi
if [[ $what == s8 ]]; then  # session 8 README run, one call, most needed first
  bash "$0" gputests
  export BENCH_TIMEOUT=100
  BENCH_TIMEOUT=150 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 120
  readme_presets
  FGCHAT_ATTN_PRELOAD=0 BENCH_TIMEOUT=60 bench 1b-no-preload --preset llama-3.2-1b --random-weights \
    --batch-sizes 1,8 --repeats 3 --modes full
  timeout 60 python3 scripts/profile_host.py llama-3.2-1b > "$OUT/profile_host.txt" 2>&1
fi
if [[ $what == s9 ]]; then  # the current K/V row re-read from the cache or from registers (alternating processes)
  bash "$0" gputests
  export BENCH_TIMEOUT=90
  for i in 1 2; do
    FGCHAT_ATTN_CUR_FROM_CACHE=1 bench "1b-cache-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
      --repeats 3 --modes piecewise,full
    FGCHAT_ATTN_CUR_FROM_CACHE=0 bench "1b-regs-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
      --repeats 3 --modes piecewise,full
  done
  FGCHAT_ATTN_CUR_FROM_CACHE=1 bench 135m-cache --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3 --modes full
  FGCHAT_ATTN_CUR_FROM_CACHE=0 bench 135m-regs --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3 --modes full
  FGCHAT_ATTN_CUR_FROM_CACHE=0 bench 8b-regs --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes full
fi
if [[ $what == s10 ]]; then  # the README run (GPU tests run in the call before it: s9, s11), most needed first
  export BENCH_TIMEOUT=100
  BENCH_TIMEOUT=150 bench llama-3.2-1b-peers --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
    --repeats 3 --modes full --peers hf --peer-timeout 120
  readme_presets
  FGCHAT_ATTN_CUR_FROM_CACHE=1 BENCH_TIMEOUT=60 bench 1b-cur-from-cache --preset llama-3.2-1b --random-weights \
    --batch-sizes 1,8 --repeats 3 --modes full
  FGCHAT_ATTN_PRELOAD=0 BENCH_TIMEOUT=60 bench 1b-no-preload --preset llama-3.2-1b --random-weights \
    --batch-sizes 1,8 --repeats 3 --modes full
  timeout 60 python3 scripts/profile_host.py llama-3.2-1b > "$OUT/profile_host.txt" 2>&1
fi
if [[ $what == s11 ]]; then  # piecewise attention launches bound once vs per call (alternating processes), GPU tests
  bash "$0" gputests
  export BENCH_TIMEOUT=90
  for i in 1 2; do
    bench "1b-bound-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes piecewise,full
    FGCHAT_BOUND_ATTENTION=0 bench "1b-unbound-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
      --repeats 3 --modes piecewise,full
  done
  bench 135m-bound --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3 --modes piecewise
  FGCHAT_BOUND_ATTENTION=0 bench 135m-unbound --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3 --modes piecewise
fi
if [[ $what == s12 ]]; then  # the README run after s11 (same commit); one archive, since a call returns 8 files
  bash "$0" s10
  (cd "$OUT" && tar czf s12.tgz bench_*.json run.log profile_host.txt && rm -f bench_*.json profile_host.txt)
fi
if [[ $what == s13 ]]; then  # eager host diagnostics: host load, per-launch cost, first-block effect
  { nproc; cat /proc/loadavg; grep -m3 -E "MHz|model name" /proc/cpuinfo; } > "$OUT/host.txt" 2>&1
  timeout 60 python3 -c "from fgchat.engine.kernels import launch; print(launch.measure_launch_us(1, 2048)); print(launch.measure_launch_us(8, 4096))" \
    >> "$OUT/host.txt" 2>&1
  export BENCH_TIMEOUT=120
  bench 1b-eager-order --preset llama-3.2-1b --random-weights --batch-sizes 1,8,1,8 --repeats 3 --modes eager
  bench 135m-eager-order --preset smollm2-135m --random-weights --batch-sizes 8,1,8,1 --repeats 3 --modes eager,piecewise
  { cat /proc/loadavg; grep -m1 MHz /proc/cpuinfo; } >> "$OUT/host.txt" 2>&1
fi
if [[ $what == s14 ]]; then  # eager launch lists: GPU tests of the step paths, then lists vs stages (alternating)
  timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu_graphs.py tests/test_launch.py -q \
    --timeout 120 -W ignore -x 2>&1 | tee -a "$OUT/run.log" | tail -8
  export BENCH_TIMEOUT=60
  for i in 1 2; do
    bench "1b-list-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 3 --modes eager
    FGCHAT_EAGER_LAUNCH_LIST=0 bench "1b-stages-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
      --repeats 3 --modes eager
  done
  bench 135m-list --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3 --modes eager
  FGCHAT_EAGER_LAUNCH_LIST=0 bench 135m-stages --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 3 --modes eager
  timeout 100 python3 -m pytest -p no:cacheprovider -m gpu $GPU_TESTS -q --timeout 120 -W ignore \
    --deselect tests/test_gpu_graphs.py 2>&1 | tee -a "$OUT/run.log" | tail -5
fi
