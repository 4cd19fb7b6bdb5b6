#!/usr/bin/env bash
# The main job of the README: set up, start the stack on the embedded default
# model, and stream a completion to the terminal. `kvpop down` stops the stack.
# Without an argument the prompt is a register-tracking task from our own
# generator (the default model is trained on those tasks), served with a KV
# budget of a quarter of the sequence.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -gt 0 ]; then
  PROMPT=$1
else
  TASK=$(.venv/bin/kvpop tasks --family registers --n 1 --length 600 --seed 7 --json)
  PROMPT=$(printf '%s' "$TASK" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["prompt"])')
  EXPECTED=$(printf '%s' "$TASK" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["answer"])')
  echo "prompt: ${PROMPT:0:160} ... ${PROMPT: -40}" >&2
  echo "expected answer: $EXPECTED" >&2
fi
[ -f .kvpop/stack.json ] || .venv/bin/kvpop up
.venv/bin/kvpop generate "$PROMPT" --max-tokens 32 --kv-budget 0.25
echo "stack still running: '.venv/bin/kvpop down' stops it" >&2
