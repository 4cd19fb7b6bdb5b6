#!/usr/bin/env bash
# Refresh constraints.txt: install the package with its test extra into a
# scratch venv from pyproject's ranges alone (today's registry), and write what
# pip chose. Run the suite afterwards (bash scripts/test.sh) before committing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
echo "resolving into $tmp/venv (log: $tmp/lock.log, shown on failure)" >&2
{
  "$tmp/venv/bin/python" -m pip install -q --upgrade pip &&
  "$tmp/venv/bin/python" -m pip install -q torch==2.13.0 &&
  "$tmp/venv/bin/python" -m pip install -q -e ".[test]"
} > "$tmp/lock.log" 2>&1 || { tail -40 "$tmp/lock.log" >&2; exit 1; }
{
  sed -n '1,/^# Refresh/p' constraints.txt
  # torch is pinned in pyproject and comes from a CUDA index in the image.
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v -i -E "^(torch|kvpop-serving|pip|setuptools|wheel)=="
} > "$tmp/constraints.txt"
mv "$tmp/constraints.txt" constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins)" >&2
