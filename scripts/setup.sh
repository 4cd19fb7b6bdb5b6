#!/usr/bin/env bash
# Idempotent setup: .venv with our pinned torch first (so nothing pulls a CUDA
# build), the package with its test extra under constraints.txt (the versions
# CI passed with), and a redis-server binary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if [ ! -x .venv/bin/python ]; then
  # Debian splits venv/ensurepip out of the interpreter package.
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq python3-venv >/dev/null
    "$PY" -m venv .venv
  fi
fi
stamp=.venv/.kvpop-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "installing into .venv (log: .venv/install.log)" >&2
  {
    .venv/bin/python -m pip install -q --upgrade pip &&
    .venv/bin/python -m pip install -q torch==2.13.0 &&
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  } > .venv/install.log 2>&1 || { tail -40 .venv/install.log >&2; exit 1; }
  touch "$stamp"
fi
if ! command -v redis-server >/dev/null; then
  echo "redis-server not found: installing Debian's redis-server" >&2
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
