#!/usr/bin/env bash
# One device call for per-shape rows and the agent workload, from the repo root on the GPU
# machine, in order (each step logs and the script goes on when one fails; no step starts
# within 30 s of DEADLINE seconds):
#   1. AGENT=1: `bench serve --workload agent` on AGENT_SHAPE (qwen3-30b-a3b) at AGENT_LAYERS
#      (12) layers, 25 % expert budget, one conversation of AGENT_TURNS (6) turns, each adding a
#      TOOL_LEN (2,048)-token tool result; TTFT per turn against a fresh request holding only
#      the turn's new tokens, with --compare-prefix-off unless AGENT_OFF=0;
#   1b. CONTENTION=1: `bench serve --workload contention` on the same shape at CONT_BUDGETS
#      (100% 25%): decoders' ITL while a CONT_LONG-token prompt is prefilled (see below);
#   2. KV_SPLIT=1: `bench latency --gpu-memory GPU_MEMORY` with bf16 and int8 KV at batch 1
#      and 16 (KV_BATCHES) on the 12-layer Qwen3-30B-A3B shape (scripts/gpu_kv_split.sh's
#      runs, with KV_LAYERS, KV_MAX_LEN for its LAYERS, MAX_LEN; the arithmetic is there);
#   3. ROWS: `bench latency` rows, one per entry "shape[:layers[:k=v,k=v]]" (layers empty: the
#      shape's real depth; the settings go to --set), at ROW_BUDGETS (100%,25%), batch 1,
#      64-token prompt, 32 new tokens, uniform routing (trace routing with TRACE for shapes of
#      128 experts top-8), then ROW_ARGS (later flags win: --input-len 2048); a shape's
#      checkpoint is deleted after its last consecutive row (kept with ROW_KEEP=1).
# Results under $OUT: summary.md, rows-results.tar.gz, gpu_rows.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/rows"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-560}
ROW_BUDGETS=${ROW_BUDGETS:-100%,25%}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_rows.log"
TAG=gpu_rows
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"

if [ "${AGENT:-0}" = 1 ]; then
  L=${AGENT_LAYERS:-12}
  A=${AGENT_SHAPE:-qwen3-30b-a3b}
  if step agent-generate python3 -m moetier bench synthetic "$A" --layers "$L" --seed 0; then
    Q3=$(ls -d "$MOETIER_HOME"/synthetic/"$A"-L"$L"-s0 | head -n 1)
    off=(--compare-prefix-off)
    [ "${AGENT_OFF:-1}" = 0 ] && off=()
    step agent python3 -m moetier bench serve --model "$Q3" --expert-budget 25% \
      --dtype bfloat16 --workload agent --dataset random --turns "${AGENT_TURNS:-6}" \
      --tool-result-len "${TOOL_LEN:-2048}" --input-len 128 --output-len 16 --num-prompts 1 \
      --seed 0 --server-timeout 240 --serve-args "--max-model-len ${AGENT_MAX_LEN:-16384}" "${off[@]}" \
      --server-log "$WORK/agent-server.log" --save-result "$WORK/agent.json" --no-progress
    grep -A12 "^| turn" "$WORK/agent.log" >"$WORK/agent.md" 2>/dev/null
  fi
fi

if [ "${CONTENTION:-0}" = 1 ]; then
  # `bench serve --workload contention`: CONT_DECODERS (4) requests decode while one
  # CONT_LONG (4,096)-token prompt is prefilled in chunks of CONT_CHUNK (512) tokens; decoder
  # ITL before / during / after, against one chunk's time (issue #19 item 4)
  L=${AGENT_LAYERS:-12}
  A=${AGENT_SHAPE:-qwen3-30b-a3b}
  if step contention-generate python3 -m moetier bench synthetic "$A" --layers "$L" --seed 0; then
    Q3=$(ls -d "$MOETIER_HOME"/synthetic/"$A"-L"$L"-s0 | head -n 1)
    for b in ${CONT_BUDGETS:-100% 25%}; do
      step "contention-${b%\%}" python3 -m moetier bench serve --model "$Q3" --expert-budget "$b" \
        --dtype bfloat16 --workload contention --dataset random --decoders "${CONT_DECODERS:-4}" \
        --input-len 128 --output-len "${CONT_OUTPUT:-256}" --contention-after 16 \
        --long-len "${CONT_LONG:-4096}" --temperature 0 --seed 0 --server-timeout 240 \
        --serve-args "--max-num-batched-tokens ${CONT_CHUNK:-512} --max-model-len 8192" \
        --server-log "$WORK/contention-${b%\%}-server.log" \
        --save-result "$WORK/contention-${b%\%}.json" --no-progress
    done
  fi
fi

if [ "${KV_SPLIT:-0}" = 1 ]; then
  # the runs and the default budget's arithmetic: scripts/gpu_kv_split.sh
  source scripts/gpu_kv_split.sh
  LAYERS=${KV_LAYERS:-12} MAX_LEN=${KV_MAX_LEN:-32768} BATCHES=${KV_BATCHES:-1 16} kv_split
fi

rows=(${ROWS:-})
for i in "${!rows[@]}"; do
  IFS=: read -r shape layers sets <<<"${rows[$i]}"
  layer_args=()
  [ -n "$layers" ] && layer_args=(--layers "$layers")
  routing=uniform
  case $shape in qwen3-30b-a3b | qwen3-235b-a22b) routing="trace:$TRACE" ;; esac
  tag="$shape${layers:+-L$layers}${sets:+-${sets//[=,]/-}}"
  if step "$tag-generate" python3 -m moetier bench synthetic "$shape" "${layer_args[@]}" --seed 0; then
    latency "$tag" --synthetic "$shape" "${layer_args[@]}" --expert-budget "$ROW_BUDGETS" \
      --routing "$routing" ${sets:+--set "${sets//,/ }"} ${ROW_ARGS:-}
  fi
  next=${rows[$((i + 1))]:-}
  [ "${next%%:*}" = "$shape" ] || [ "${ROW_KEEP:-0}" = 1 ] || rm -rf "$MOETIER_HOME/synthetic/$shape-"*
done

summarize "$WORK/agent.log"
