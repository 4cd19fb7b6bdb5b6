#!/usr/bin/env bash
# GPU check for kernels/: kernel-vs-reference tests, then the benchmark.
#
#   bash kvkernels/gpu_check.sh            # writes to ${OUT:-./gpu_out}
#   BENCH_ARGS=--dry-run bash kvkernels/gpu_check.sh   # CPU smoke run of the same script
#
# Needs only python with torch (CUDA build) and CuPy (`import cupy`, CUDA 12
# or 13 build) plus this repository; installs nothing. pytest is used when
# present, else the test module runs as a plain script. About 5-8 minutes on
# an H200: tests <= 180 s, bench <= 360 s (hard timeouts below).
# Outputs: env.txt, tests.log (+ tests.xml), bench.log, bench.json, bench.md,
# bench.png (when matplotlib is there); then, when the serving stack's packages
# import (the compose image, or `pip install -e .`): step.log/step.json (one
# decode step's host cost per policy, `kvpop bench step`) and, when redis-server
# is on the PATH, serve/ (`kvpop bench serve` at saturation, dense vs learned vs h2o).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/kvpop-cupy-cache}"
export PYTHONUNBUFFERED=1
status=0

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv
  "$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
try:
    import cupy
    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as e:
    print("cupy NOT usable:", type(e).__name__, e)
from kvkernels import ops
print("kernels backend for a cuda tensor:",
      ops.backend_for(torch.empty(0, device="cuda")) if torch.cuda.is_available() else "n/a")
PYEOF
} 2>&1 | tee "$OUT/env.txt"

if ! "$PY" -c "import torch, sys; from kvkernels import cuda; sys.exit(0 if cuda.available() else 1)"; then
  echo "!! CUDA kernels unavailable (no CUDA device or CuPy): tests will skip, bench runs the references" | tee -a "$OUT/env.txt"
  status=2
fi

echo "== (a) kernel tests" | tee "$OUT/tests.log"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 180 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/tests.xml" \
    tests/unit/kernels/test_cuda.py 2>&1 | tee -a "$OUT/tests.log"
else
  timeout 180 "$PY" tests/unit/kernels/test_cuda.py 2>&1 | tee -a "$OUT/tests.log"
fi
rc=${PIPESTATUS[0]}
echo "tests exit code: $rc" | tee -a "$OUT/tests.log"
[ "$rc" -ne 0 ] && status=1

echo "== (b) benchmark" | tee "$OUT/bench.log"
timeout 360 "$PY" -m kvpop.bench.kernels --out "$OUT" --time-budget 250 ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
rc=${PIPESTATUS[0]}
echo "bench exit code: $rc" | tee -a "$OUT/bench.log"
[ "$rc" -ne 0 ] && status=1

KVPOP=("$PY" -c "import sys; from kvpop.cli import main; sys.exit(main(sys.argv[1:]))")
STEP_ARGS=(--sequences 14,48,96); SERVE_ARGS=(--rates inf)
if [[ " ${BENCH_ARGS:-} " == *" --dry-run "* ]]; then    # the CPU smoke run: tiny sizes
  STEP_ARGS=(--sequences 2 --steps 4); SERVE_ARGS=(--quick)
fi
if "$PY" -c "import grpc, redis, opentelemetry.sdk, kvpop.bench.serve" 2>/dev/null; then
  echo "== (c) decode step cost" | tee "$OUT/step.log"
  timeout 300 "${KVPOP[@]}" bench step --device auto "${STEP_ARGS[@]}" --json "$OUT/step.json" 2>&1 | tee -a "$OUT/step.log"
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  if command -v redis-server >/dev/null; then
    echo "== (d) serving benchmark" | tee "$OUT/serve.log"
    OTEL_TRACES_EXPORTER=none timeout 300 "${KVPOP[@]}" bench serve --policies dense,learned,h2o \
      "${SERVE_ARGS[@]}" --out "$OUT/serve" 2>&1 | tee -a "$OUT/serve.log"
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  else
    echo "== (d) serving benchmark skipped: no redis-server on the PATH" | tee "$OUT/serve.log"
  fi
else
  echo "== (c, d) skipped: the serving stack's packages do not import (pip install -e . first)" | tee "$OUT/step.log"
fi

echo "== done (status $status); results in $OUT"
exit $status
