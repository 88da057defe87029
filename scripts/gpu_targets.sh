#!/usr/bin/env bash
# One device call for the full-depth prefill and agent targets (issues #19, #24), from the repo
# root on the GPU machine, in order (each step logs and the script goes on when one fails; no
# step starts within 30 s of DEADLINE seconds):
#   1. GPU tests: the bench's device-drawn uniform routing; DeepSeek-V2/V3 parity and prefill
#      graphs (MLA's fresh-prompt steps in the expanded form, flash); SKIP_TESTS=1 skips;
#   2. DeepSeek-V2-Lite (27 layers): TTFT of 2,048- and 64-token prompts, every expert resident,
#      uniform routing (now drawn on the device), with MLA's fresh-prompt steps expanded and
#      absorbed (MLA_EXPANDED_FRESH=1 / 0; MLA_AB and DSV2_PROMPTS pick); then where one 2,048-token prompt
#      step's host and device time go, expanded (scripts/gpu_step_profile.py --routing uniform);
#   3. Qwen3-30B-A3B (48 layers; SKIP_Q3=1 skips; SKIP_DSV2=1 skips step 2): TTFT of 64 tokens
#      (uniform) and 2,048 tokens (trace) at 100 % and 25 %, then at 25 % with each entry of
#      Q3_SETS (settings k=v,k=v; e.g. transfer_window=4,stream_eviction=true), then, with the
#      time left, the agent workload at 25 % (6 turns, each adding a 2,048-token tool result,
#      against fresh requests of the turn's new tokens).
# Results under $OUT: summary.md, targets-results.tar.gz, gpu_targets.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/targets"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-560}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_targets.log"
TAG=gpu_targets
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh

# ttft NAME ARGS...: one `bench latency` with 8 output tokens (TTFT is the point), WARMUP (1)
# warm-up requests first
ttft() {
  local name=$1
  shift
  step "$name" python3 -m moetier -v bench latency --output-len 8 --seed 0 --warmup "${WARMUP:-1}" \
    --no-progress --profile-steps 0 --save-result "$WORK/$name.json" "$@"
  [ -f "$WORK/$name.json" ] && python3 - "$WORK/$name.json" >"$WORK/$name.md" <<'PY'
import json, sys
from moetier.bench.report import latency_table
print(latency_table(json.load(open(sys.argv[1]))))
PY
}

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
[ "${SKIP_TESTS:-0}" = 1 ] || step tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_routing_override.py \
  tests/gpu/test_gpu_prefill_graphs.py tests/gpu/test_gpu_parity.py -k "routing or deepseek_v2 or deepseek_v3" \
  -rs --junitxml="$WORK/junit-targets.xml"

if [ "${SKIP_DSV2:-0}" != 1 ] && step dsv2-generate python3 -m moetier bench synthetic deepseek-v2-lite --seed 0; then
  D=(--synthetic deepseek-v2-lite --expert-budget 100% --routing uniform)
  # MLA's fresh-prompt steps expanded (1) or absorbed (0), A/B in this call
  for on in ${MLA_AB:-1 0}; do
    for n in ${DSV2_PROMPTS:-2048 64}; do
      MLA_EXPANDED_FRESH=$on ttft "dsv2-p$n-mla$on" "${D[@]}" --input-len "$n"
    done
  done
  MLA_EXPANDED_FRESH=1 step dsv2-profile python3 scripts/gpu_step_profile.py \
    "$(ls -d "$MOETIER_HOME"/synthetic/deepseek-v2-lite-L27-s0 | head -n 1)" \
    --prompts 2048 --batch 0 --routing uniform
  rm -rf "$MOETIER_HOME"/synthetic/deepseek-v2-lite-*
fi

if [ "${SKIP_Q3:-0}" != 1 ]; then
  Q=(--synthetic qwen3-30b-a3b --layers 48)
  ttft q3-p64 "${Q[@]}" --expert-budget 100% --routing uniform --input-len 64
  ttft q3-p2048 "${Q[@]}" --expert-budget 100%,25% --routing "trace:$TRACE" --input-len 2048
  # Q3_SETS: more 25% rows of the 2,048-token prompt, one per entry of settings (k=v,k=v)
  for s in ${Q3_SETS:-}; do
    ttft "q3-p2048-${s//[=,]/-}" "${Q[@]}" --expert-budget 25% --routing "trace:$TRACE" \
      --input-len 2048 --set "${s//,/ }"
  done
  # the agent workload last: it takes what time is left (its checkpoint is the rows')
  env OUT="$WORK/agent" DEADLINE=$(($(left) - 10)) AGENT=1 AGENT_LAYERS=48 ROW_KEEP=1 \
    bash scripts/gpu_rows.sh >/dev/null 2>&1
  cp "$WORK/agent/summary.md" "$WORK/agent-48.md" 2>/dev/null
fi

summarize "$WORK/tests.log"
