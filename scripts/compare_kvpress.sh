#!/usr/bin/env bash
# NVIDIA kvpress's presses on the same real-text prompts as `kvpop eval --suite real`,
# on the transformers model, as the peer reference (docs/results/long-context.md).
# kvpress pins transformers < 5.3 (the test extra takes a newer one), so it gets its
# own venv, .venv-compare, with the `compare` extra. Arguments go to `python -m kvpop.bench.compare_kvpress`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -f .venv-compare/.installed ] || [ pyproject.toml -nt .venv-compare/.installed ]; then
  echo "installing kvpress into .venv-compare (log: .venv-compare/install.log)" >&2
  "$PY" -m venv .venv-compare
  {
    .venv-compare/bin/python -m pip install -q --upgrade pip &&
    .venv-compare/bin/python -m pip install -q torch==2.13.0 &&
    .venv-compare/bin/python -m pip install -q -e ".[compare]"
  } > .venv-compare/install.log 2>&1 || { tail -40 .venv-compare/install.log >&2; exit 1; }
  touch .venv-compare/.installed
fi
exec .venv-compare/bin/python -m kvpop.bench.compare_kvpress "$@"
