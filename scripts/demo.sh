#!/usr/bin/env bash
# The main job of the README: set up, start the stack on the embedded default
# model, and stream a completion to the terminal. `kvpop down` stops the stack.
# Without an argument the prompt is a register-tracking task from our own
# generator (the default model is trained on those tasks), served with a KV
# budget of a quarter of the sequence.
# A stack already in .kvpop (or $KVPOP_STATE_DIR) is used only when it is up
# and serves the default model; otherwise the script says what to do.
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
STATE=${KVPOP_STATE_DIR:-.kvpop}
if [ -f "$STATE/stack.json" ]; then
  # exit 0: every service up and SERVING; 1: something is not; the JSON names the model.
  STATUS=$(.venv/bin/kvpop status --json 2>/dev/null) && UP=1 || UP=0
  MODEL=$(printf '%s' "$STATUS" | .venv/bin/python -c 'import json,sys
try: print(json.load(sys.stdin).get("model") or "")
except ValueError: print("")')
  if [ "$UP" = 0 ]; then
    echo "demo: the stack in $STATE is not all up and SERVING (see '.venv/bin/kvpop status');" \
         "stop it with '.venv/bin/kvpop down' and run the demo again" >&2
    exit 1
  fi
  if [ "$MODEL" != default ]; then
    echo "demo: the stack in $STATE serves ${MODEL:-a model it does not name}, not the default model;" \
         "stop it with '.venv/bin/kvpop down' and run the demo again" >&2
    exit 1
  fi
  echo "demo: using the running stack in $STATE (default model)" >&2
else
  .venv/bin/kvpop up
fi
.venv/bin/kvpop generate "$PROMPT" --max-tokens 32 --budget 0.25
echo "stack still running: '.venv/bin/kvpop down' stops it" >&2
