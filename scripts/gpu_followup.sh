#!/usr/bin/env bash
# One device call for the work that landed without a GPU run (2026-12-06), from the repo root on
# the GPU machine, in priority order (each step logs and the script goes on when one fails; no
# step starts within 30 s of DEADLINE seconds):
#   1. GPU tests: Gemma 4 on the expert kernels (GELU_TANH) across tests/gpu, and the MXFP4
#      compressed kernels and graphs (gpt-oss);
#   2. scripts/gpu_formats.py SWEEP=0: every slot format's kernels timed (Qwen3-30B-A3B expert);
#   3. rows (scripts/gpu_rows.sh): Gemma-4-26B-A4B at 12 layers, 100 / 25 % (TPOT before the
#      kernels: 41.61 ms, 0 graph replays, H100); then the Qwen3-30B-A3B shape at 12 layers, a
#      2,048-token prompt at 25 %, stream_eviction on and off (TTFT, prefill H2D bytes, greedy
#      tokens); then ROWS_MORE (GLM-4.5-Air and DeepSeek-V4-Flash at 4 layers, gpt-oss-120b at
#      12), 100 / 25 % (ROWS_MORE= skips them).
# Results under $OUT, three files (the device tool returns at most eight): summary.md,
# followup-results.tar.gz (every log, JSON and table), gpu_followup.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/followup"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-570}
ROWS_MORE=${ROWS_MORE-glm-4.5-air:4 deepseek-v4-flash:4 gpt-oss-120b:12}
LOG="$OUT/gpu_followup.log"
TAG=gpu_followup
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
# EXTRA_TESTS: more test files and a -k expression joined to this step's (one pytest start)
step tests-gemma4 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu ${EXTRA_TESTS:-} \
  -k "gemma4 or gelu${EXTRA_K:+ or $EXTRA_K}" \
  -rs --junitxml="$WORK/junit-gemma4.xml"
step tests-mxfp4 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_gpu_compressed_kernels.py tests/gpu/test_gpu_graphs.py -k "mxfp4 or gpt_oss" \
  -rs --junitxml="$WORK/junit-mxfp4.xml"
mkdir -p "$WORK/formats"
OUT="$WORK/formats" SWEEP=0 step formats python3 scripts/gpu_formats.py
cp "$WORK/formats/formats.md" "$WORK/formats.md" 2>/dev/null

# the rows, each call of gpu_rows.sh under what is left of this call's deadline
rows() {
  local name=$1
  shift
  local budget
  budget=$(left)
  [ "$budget" -ge 60 ] || { log "skip rows $name: $budget s left"; return 1; }
  log "rows $name: $*"
  env OUT="$WORK/$name" DEADLINE=$((budget - 10)) "$@" bash scripts/gpu_rows.sh >/dev/null 2>&1
  cp "$WORK/$name/summary.md" "$WORK/rows-$name.md" 2>/dev/null
}
rows gemma4 ROWS="gemma-4-26b-a4b:12"
rows stream ROWS="qwen3-30b-a3b:12 qwen3-30b-a3b:12:stream_eviction=true" ROW_BUDGETS=25% \
  ROW_ARGS="--input-len 2048"
[ -n "$ROWS_MORE" ] && rows more ROWS="$ROWS_MORE"

summarize "$WORK/tests-gemma4.log"
