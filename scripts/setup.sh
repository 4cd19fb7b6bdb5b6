#!/usr/bin/env bash
# Idempotent setup: .venv with our pinned torch first (so nothing pulls a CUDA
# build), the package with its test extra under constraints.txt (the versions
# CI passed with), a redis-server binary, Debian's prometheus (promtool
# included) for the monitoring tests, and checkov in its own venv.
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
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "prometheus not found: installing Debian's prometheus" >&2
  # Only the binaries are used (tests start their own on a free port); where the
  # package cannot be installed, the Prometheus tests skip and say why.
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq prometheus >/dev/null; } ||
    echo "warning: Debian's prometheus could not be installed: the Prometheus tests will skip" >&2
fi
# checkov (static security checks of deploy/k8s) pins older packaging,
# networkx and python-dateutil than the project: its own venv, its own pin.
CHECKOV_VERSION=3.3.30
if [ ! -x .venv-checkov/bin/checkov ] || ! .venv-checkov/bin/checkov --version 2>/dev/null | grep -qx "$CHECKOV_VERSION"; then
  echo "installing checkov $CHECKOV_VERSION into .venv-checkov (log: .venv-checkov/install.log)" >&2
  rm -rf .venv-checkov
  "$PY" -m venv .venv-checkov
  .venv-checkov/bin/python -m pip install -q "checkov==$CHECKOV_VERSION" > .venv-checkov/install.log 2>&1 ||
    { tail -40 .venv-checkov/install.log >&2; exit 1; }
fi
