#!/usr/bin/env bash
# One device call for the grouped expert kernel and prefill, from the repo root on the GPU
# machine, in priority order (each step logs and the script goes on when one fails; no step
# starts within 30 s of DEADLINE seconds):
#   1. the GPU test suite (tests/gpu; GPU_TESTS= picks files) unless SKIP_TESTS=1;
#   2. the kernel sweep (scripts/gpu_grouped_sweep.py: slot vs grouped kernel, launch shapes)
#      unless SKIP_SWEEP=1;
#   3. per shape in SHAPES (real depth unless LAYERS): `bench latency` TTFT at 100% for prompts
#      of 64 and 2,048 tokens with the grouped kernel (today's default) and, with OLD=1, without
#      it (the loop / gather path); 25% at 2,048 tokens with trace routing; batch 1 and
#      BATCH (64) decode at 100% (tokens/s against batch 1).
# Results under $OUT: gpu_tests.log, summary.md, prefill-results.tar.gz, gpu_prefill.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/prefill"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-570}
SHAPES=${SHAPES:-qwen3-30b-a3b}
LAYERS=${LAYERS:-}
BATCH=${BATCH:-64}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_prefill.log"
TAG=gpu_prefill
source scripts/gpu_steps.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
    --junitxml="$OUT/gpu-junit.xml" ${GPU_TESTS:-tests/gpu}
  cp "$WORK/gpu-tests.log" "$OUT/gpu_tests.log" 2>/dev/null
fi
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  step sweep env OUT="$WORK" python3 scripts/gpu_grouped_sweep.py --deadline "${SWEEP_S:-200}"
  cp "$WORK/grouped-sweep.md" "$WORK/sweep.md" 2>/dev/null
fi

# ttft NAME ARGS...: one `bench latency` with few output tokens (TTFT is the point)
ttft() {
  local name=$1
  shift
  step "$name" python3 -m moetier -v bench latency --output-len "${OUTPUT_LEN:-8}" --seed 0 \
    --warmup 1 --no-progress --profile-steps 0 --save-result "$WORK/$name.json" "$@"
  [ -f "$WORK/$name.json" ] && python3 - "$WORK/$name.json" >"$WORK/$name.md" <<'PY'
import json, sys
from moetier.bench.report import latency_table
print(latency_table(json.load(open(sys.argv[1]))))
PY
}

for shape in $SHAPES; do
  layer_args=()
  [ -n "$LAYERS" ] && layer_args=(--layers "$LAYERS")
  tag="$shape${LAYERS:+-L$LAYERS}"
  if step "$tag-generate" python3 -m moetier bench synthetic "$shape" "${layer_args[@]}" --seed 0; then
    S=(--synthetic "$shape" "${layer_args[@]}")
    ttft "$tag-p64" "${S[@]}" --expert-budget 100% --routing uniform --input-len 64
    ttft "$tag-p2048" "${S[@]}" --expert-budget 100%,25% --routing "trace:$TRACE" \
      --input-len 2048
    if [ "${OLD:-0}" = 1 ]; then
      ttft "$tag-p64-old" "${S[@]}" --expert-budget 100% --routing uniform --input-len 64 \
        --set "moe_grouped_kernel=false"
    fi
    ttft "$tag-b1" "${S[@]}" --expert-budget 100% --routing uniform --input-len 64 \
      --output-len 32 --batch-size 1
    ttft "$tag-b$BATCH" "${S[@]}" --expert-budget 100% --routing uniform --input-len 64 \
      --output-len 32 --batch-size "$BATCH" --num-prompts "$BATCH"
    rm -rf "$MOETIER_HOME/synthetic/$shape-"*
  fi
done

summarize "$OUT/gpu_tests.log"
