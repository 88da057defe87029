#!/usr/bin/env bash
# One device call for the device-resident expert cache and compressed experts, from the repo
# root on the GPU machine, in priority order (each step logs and the script goes on when one
# fails; no step starts within 30 s of DEADLINE seconds):
#   1. the GPU test suite (tests/gpu; GPU_TESTS= picks files) unless SKIP_TESTS=1;
#   2. the compressed-slot kernels' bandwidth (scripts/gpu_formats.py) unless SKIP_FORMATS=1;
#   3. Qwen3-30B-A3B (real depth unless LAYERS), trace routing, 25%: TPOT at batch 1 on the host
#      path, with --device-cache (lru, then layer-lru), and batch BATCH (16) the same three;
#   4. the FP8 synthetic of the same shape at 25% of bf16 bytes, host path and device cache.
# Results under $OUT: gpu_tests.log, gpu-junit.xml (scripts/compat_matrix.py --gpu-junit), summary.md, device-cache-results.tar.gz, the log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/device-cache"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-570}
SHAPE=${SHAPE:-qwen3-30b-a3b}
LAYERS=${LAYERS:-}
BATCH=${BATCH:-16}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_device_cache.log"
TAG=gpu_device_cache
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 \
    --junitxml="$OUT/gpu-junit.xml" ${GPU_TESTS:-tests/gpu}
  cp "$WORK/gpu-tests.log" "$OUT/gpu_tests.log" 2>/dev/null
fi
if [ "${SKIP_FORMATS:-0}" != 1 ]; then
  step formats env OUT="$WORK" python3 scripts/gpu_formats.py
fi
layer_args=()
[ -n "$LAYERS" ] && layer_args=(--layers "$LAYERS")
DC=(--set "device_cache=true")
for fmt in bf16 fp8; do
  tag="$SHAPE${LAYERS:+-L$LAYERS}-$fmt"
  step "$tag-generate" python3 -m moetier bench synthetic "$SHAPE" "${layer_args[@]}" \
    --seed 0 --format "$fmt" || continue
  S=(--synthetic "$SHAPE" "${layer_args[@]}" --format "$fmt" --routing "trace:$TRACE")
  # FP8 at the bytes bf16's 25% buys: its experts are half the size, so 50% of FP8 bytes
  budget=25%
  [ "$fmt" = fp8 ] && budget=50%
  latency "$tag-host" "${S[@]}" --expert-budget "100%,$budget"
  latency "$tag-dc-lru" "${S[@]}" --expert-budget "100%,$budget" "${DC[@]}"
  latency "$tag-dc-layer-lru" "${S[@]}" --expert-budget "100%,$budget" "${DC[@]}" \
    --policy layer-lru
  if [ "$fmt" = bf16 ]; then
    B=(--batch-size "$BATCH" --num-prompts "$BATCH")
    latency "$tag-b$BATCH-host" "${S[@]}" "${B[@]}" --expert-budget "100%,$budget"
    latency "$tag-b$BATCH-dc-layer-lru" "${S[@]}" "${B[@]}" --expert-budget "100%,$budget" \
      "${DC[@]}" --policy layer-lru
  fi
done
cat "$WORK"/*.md >"$OUT/summary.md" 2>/dev/null
tar -czf "$OUT/device-cache-results.tar.gz" -C "$WORK" . 2>/dev/null
log "done"
