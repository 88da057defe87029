#!/usr/bin/env bash
# One device call for the expert memory system (issue #9), from the repo root on the GPU
# machine: prefetch off / on at 25 % with real-text routing replayed, batch 1, bf16, on the
# DeepSeek-V2-Lite shape (27 layers, trace demo-64x6) and the Qwen3-30B-A3B shape cut to
# Q3_LAYERS layers (trace demo-128x8); each run also measures 100 % (every expert resident) as
# its reference. PREFETCHES lists the predictors (default: last-call activation); POLICY the
# slot policy (lru). GPU_TESTS (a pytest path or -k expression) runs first when set.
# Results under $OUT: summary.md, memory-results.tar.gz, gpu_memory.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/memory"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-540}
Q3_LAYERS=${Q3_LAYERS:-12}
PREFETCHES=${PREFETCHES:-last-call activation}
POLICY=${POLICY:-lru}
SHAPES=${SHAPES:-ds q3}
LOG="$OUT/gpu_memory.log"
TAG=gpu_memory
source scripts/gpu_steps.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
if [ -n "${GPU_TESTS:-}" ]; then
  step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
fi
for shape in $SHAPES; do
  case $shape in
    ds) gen=(deepseek-v2-lite); trace=bench/traces/demo-64x6.jsonl.gz ;;
    q3) gen=(qwen3-30b-a3b --layers "$Q3_LAYERS"); trace=bench/traces/demo-128x8.jsonl.gz ;;
    tiny) gen=(tiny-qwen3); trace=bench/traces/demo-128x8.jsonl.gz ;;  # a CPU dry run
  esac
  step "$shape-generate" python3 -m moetier bench synthetic "${gen[@]}" --seed 0 || continue
  model=$(ls -d "$MOETIER_HOME"/synthetic/"${gen[0]}"*-s0 | head -n 1)
  common=(--model "$model" --dtype bfloat16 --expert-budget 100%,25% --routing "trace:$trace"
    --policy "$POLICY")
  latency "$shape-$POLICY-off" "${common[@]}"
  for p in $PREFETCHES; do
    latency "$shape-$POLICY-$p" "${common[@]}" --prefetch "$p"
  done
done

summarize "$WORK/gpu-tests.log"
