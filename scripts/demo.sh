#!/usr/bin/env bash
# The main job of the README: set up, start the stack on the embedded default
# model, and stream a completion to the terminal. `kvpop down` stops the stack.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-"passkey 7 3 9 1 . the grass is green . the sky is blue . what is the passkey ?"}
.venv/bin/kvpop up
.venv/bin/kvpop generate "$PROMPT" --max-tokens 32
echo "stack still running: '.venv/bin/kvpop down' stops it" >&2
