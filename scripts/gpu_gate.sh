#!/usr/bin/env bash
# One device call running `moetier bench gate` on the GPU, from the repo root: CANDIDATE against
# BASELINE (k=v settings) on the Qwen3-30B-A3B and DeepSeek-V2-Lite shapes cut to LAYERS layers,
# seeds 0 and 1 (one synthetic checkpoint per shape), 25 % expert budget, bf16, real-text
# routing replayed (TRACE), INPUT_LEN-token prompts (64), rule 1 on METRIC (decode; prefill: TTFT), for each batch size in BATCHES, in that order (a gate does not start
# with less than 30 s before DEADLINE). Results under $OUT: summary.md (every gate's table),
# gate-results.tar.gz (tables, JSON, logs), gpu_gate.log (the device tool returns 8 files).
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/gate"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-540}
LAYERS=${LAYERS:-8}
BATCHES=${BATCHES:-1 4}
BASELINE=${BASELINE:-policy=lru}
CANDIDATE=${CANDIDATE:-policy=least-stale}
NAME=${NAME:-policy-least-stale-h200}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_gate.log"
TAG=gpu_gate
source scripts/gpu_steps.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
for b in $BATCHES; do
  step "gate-b$b" python3 -m moetier bench gate --baseline "$BASELINE profile_steps=0" \
    --candidate "$CANDIDATE profile_steps=0" --name "$NAME-b$b" \
    --shapes qwen3-30b-a3b,deepseek-v2-lite --layers "$LAYERS" --seeds 0,1 --weights-seed 0 \
    --expert-budget 25% --input-len "${INPUT_LEN:-64}" --output-len 32 --batch-size "$b" \
    --routing "trace:$TRACE" --metric "${METRIC:-decode}" --dtype bfloat16 --out-dir "$WORK" --no-progress
done
summarize /dev/null
