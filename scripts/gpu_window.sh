#!/usr/bin/env bash
# One device call for the copy stream's prefetch window and stream eviction (issues #19, #20),
# from the repo root on the GPU machine, in order (each step logs and the script goes on when
# one fails; no step starts within 30 s of DEADLINE seconds):
#   1. (SKIP_WINDOW=1 skips) scripts/gpu_transfer_window.py: prefetch GB/s through the transfer engine by window (1, 2,
#      4, 8 chunks of 8 MiB on the stream), main thread idle or busy in Python, and an on-demand
#      copy's wait mid-stream, beside one whole copy;
#   2. GPU tests named by TESTS (files) and TESTS_K (-k), when TESTS is set, for at most
#      TESTS_LIMIT seconds;
#   3. rows (scripts/gpu_rows.sh): the Qwen3-30B-A3B shape at WINDOW_LAYERS (12) layers, a
#      2,048-token prompt at 25 %, for each entry of WINDOW_SETS (settings, "-" for none);
#   4. the device timeline of one such prompt step (scripts/gpu_step_profile.py, uniform
#      routing) for each entry of PROFILE_SETS (default: none and the window of 4): link busy,
#      idle and under kernels (SKIP_PROFILE=1 skips).
# Results under $OUT: summary.md, window-results.tar.gz, gpu_window.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/window"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-560}
LOG="$OUT/gpu_window.log"
TAG=gpu_window
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
if [ "${SKIP_WINDOW:-0}" != 1 ]; then
  step window python3 scripts/gpu_transfer_window.py --out "$WORK/window.json"
  grep -A20 "^device:" "$WORK/window.log" >"$WORK/window.md" 2>/dev/null
fi
if [ -n "${TESTS:-}" ]; then
  step tests timeout -k 5 "${TESTS_LIMIT:-600}" python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS ${TESTS_K:+-k "$TESTS_K"} \
    -rs --junitxml="$WORK/junit-window.xml"
fi
L=${WINDOW_LAYERS:-12}
rows=()
for s in ${WINDOW_SETS:-- transfer_window=4 stream_eviction=true,transfer_window=4 stream_eviction=true}; do
  if [ "$s" = - ]; then rows+=("qwen3-30b-a3b:$L"); else rows+=("qwen3-30b-a3b:$L:$s"); fi
done
budget=$(left)
if [ "$budget" -ge 60 ]; then
  env OUT="$WORK/rows" DEADLINE=$((budget - 10)) ROWS="${rows[*]}" ROW_BUDGETS=${WINDOW_BUDGETS:-25%} \
    ROW_KEEP=1 ROW_ARGS="--input-len ${WINDOW_PROMPT:-2048}" bash scripts/gpu_rows.sh >/dev/null 2>&1
  cp "$WORK/rows/summary.md" "$WORK/rows.md" 2>/dev/null
fi
M=$(ls -d "$MOETIER_HOME"/synthetic/qwen3-30b-a3b-L"$L"-s0 2>/dev/null | head -n 1)
if [ -n "$M" ] && [ "${SKIP_PROFILE:-0}" != 1 ]; then
  i=0
  for s in ${PROFILE_SETS:-- transfer_window=4}; do
    i=$((i + 1))
    step "profile-$i" python3 scripts/gpu_step_profile.py "$M" --prompts "${WINDOW_PROMPT:-2048}" \
      --batch 0 --routing uniform --budget "${WINDOW_BUDGETS:-25%}" --set "$(s=${s#-}; echo "${s//,/ }")"
    { echo "### ${s}"; grep -E "^## prompt|^timeline" "$WORK/profile-$i.log"; } >>"$WORK/profiles.md"
  done
  rm -rf "$MOETIER_HOME"/synthetic/qwen3-30b-a3b-*
fi
summarize "$WORK/tests.log"
