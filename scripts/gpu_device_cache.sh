#!/usr/bin/env bash
# One device call for the device-resident expert cache and compressed experts, from the repo
# root on the GPU machine, in priority order (each step logs and the script goes on when one
# fails; no step starts within 30 s of DEADLINE seconds):
#   0. the fill kernel's launch configurations against the copy engine (scripts/gpu_fill_sweep.py)
#      unless SKIP_FILL=1;
#   1. the GPU test suite (tests/gpu; GPU_TESTS= picks files) unless SKIP_TESTS=1, at most
#      TEST_LIMIT seconds (default: up to the deadline);
#   2. SHAPE (qwen3-30b-a3b; real depth unless LAYERS), trace routing, 25%: TPOT at batch 1 on
#      the host path and with --device-cache (lru, then layer-lru; with BEFORE=DIR also the
#      device cache with DIR's files, a tree mirroring the repo's, swapped in: an A/B of a
#      change in one call), then batch BATCH (16) device layer-lru and host;
#   3. the compressed-slot kernels' bandwidth (scripts/gpu_formats.py) unless SKIP_FORMATS=1;
#   4. FORMATS (default fp8) synthetics of the same shape at 25% of bf16 bytes: host path and
#      device cache (the budget per format below).
# Results under $OUT: gpu_tests.log, gpu-junit.xml (scripts/compat_matrix.py --gpu-junit),
# summary.md, device-cache-results.tar.gz, the log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/device-cache"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-570}
SHAPE=${SHAPE:-qwen3-30b-a3b}
LAYERS=${LAYERS:-}
BATCH=${BATCH:-16}
FORMATS=${FORMATS:-fp8}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_device_cache.log"
TAG=gpu_device_cache
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh


log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
if [ "${SKIP_FILL:-0}" != 1 ]; then  # the fill kernel against the copy engine (~30 s)
  step fill-sweep env OUT="$WORK" python3 scripts/gpu_fill_sweep.py
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  saved=$DEADLINE
  [ -n "${TEST_LIMIT:-}" ] && DEADLINE=$((SECONDS - START + TEST_LIMIT))
  step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 \
    --junitxml="$OUT/gpu-junit.xml" ${GPU_TESTS:-tests/gpu}
  DEADLINE=$saved
  cp "$WORK/gpu-tests.log" "$OUT/gpu_tests.log" 2>/dev/null
fi
layer_args=()
[ -n "$LAYERS" ] && layer_args=(--layers "$LAYERS")
DC=(--set "device_cache=true")
run_shape() {  # FORMAT
  local fmt=$1 tag="$SHAPE${LAYERS:+-L$LAYERS}-$1" budget=25%
  step "$tag-generate" python3 -m moetier bench synthetic "$SHAPE" "${layer_args[@]}" \
    --seed 0 --format "$fmt" || return
  local S=(--synthetic "$SHAPE" "${layer_args[@]}" --format "$fmt" --routing "trace:$TRACE")
  # compressed formats at the bytes bf16's 25% buys (README's bytes per expert: fp8 0.500,
  # Q4_K_M 0.324, Q4_K 0.281, Q8_0 0.531 of bf16)
  case $fmt in fp8) budget=50% ;; gguf-q4_k_m) budget=77% ;; gguf-q4_k) budget=89% ;;
    gguf-q8_0) budget=47% ;; esac
  latency "$tag-host" "${S[@]}" --expert-budget "100%,$budget"
  latency "$tag-dc-lru" "${S[@]}" --expert-budget "$budget" "${DC[@]}"
  if [ "$fmt" = bf16 ] && [ -n "${BEFORE:-}" ]; then
    swap_in
    latency "$tag-dc-lru-before" "${S[@]}" --expert-budget "$budget" "${DC[@]}"
    swap_out
  fi
  latency "$tag-dc-layer-lru" "${S[@]}" --expert-budget "$budget" "${DC[@]}" --policy layer-lru
  if [ "$fmt" = bf16 ]; then
    local B=(--batch-size "$BATCH" --num-prompts "$BATCH")
    latency "$tag-b$BATCH-dc-layer-lru" "${S[@]}" "${B[@]}" --expert-budget "$budget" \
      "${DC[@]}" --policy layer-lru
    latency "$tag-b$BATCH-host" "${S[@]}" "${B[@]}" --expert-budget "$budget"
  fi
}
run_shape bf16
if [ "${SKIP_FORMATS:-0}" != 1 ]; then
  step formats env OUT="$WORK" python3 scripts/gpu_formats.py
fi
for fmt in $FORMATS; do run_shape "$fmt"; done
summarize "$WORK/gpu-tests.log"
