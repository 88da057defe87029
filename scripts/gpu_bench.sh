#!/usr/bin/env bash
# The standard latency suite on one GPU, in one call, from the repo root:
#   per shape: generate the synthetic checkpoint (GPU fill), run `moetier bench latency` at
#   BUDGETS with uniform routing (and trace routing when a trace file exists) in one process,
#   with the transformers and accelerate baselines, then delete the checkpoint (the 48-layer
#   Qwen3 shape is ~60 GB, DeepSeek-V2-Lite ~31 GB: both never fit a 64 GB disk at once).
# Each step logs and the suite goes on when one fails; the whole script stops starting new work
# DEADLINE seconds after it began (each step is killed at the deadline).
# Writes to $OUT (at most 8 files come back): summary.md (every table), bench-results.tar.gz
# (JSON, markdown, traces, logs, plots when matplotlib exists), gpu_bench.log.
# Plot afterwards on any machine: moetier bench plot RESULT.json
# Time (estimated, not yet measured): DeepSeek-V2-Lite ~4-5 min, Qwen3-30B-A3B at 48 layers
# ~6-7 min (60 GB written, three loads, transformers and accelerate loads). If one call cannot
# hold both, run SHAPES=deepseek-v2-lite and SHAPES=qwen3-30b-a3b in two calls. A latency run
# saves its JSON before the baselines start, so the deadline never loses moetier's numbers.
#
# Environment (all optional):
#   SHAPES="deepseek-v2-lite qwen3-30b-a3b"   LAYERS=  (empty: real depth)   BUDGETS=100%,25%,10%
#   ROUTING=uniform   TRACE=path.jsonl (default: first bench/traces/*.jsonl; none: skip replay)
#   COMPARE=transformers,accelerate   INPUT_LEN=64   OUTPUT_LEN=32   SEED=0   WARMUP=1
#   HOST_BUDGET_qwen3_30b_a3b=40%  (per shape; dashes as underscores)   DEADLINE=570
#   MOETIER_HOME=/tmp/moetier-bench-home   KEEP_CHECKPOINTS=0
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/bench"
mkdir -p "$WORK"
SHAPES=${SHAPES:-deepseek-v2-lite qwen3-30b-a3b}
LAYERS=${LAYERS:-}
BUDGETS=${BUDGETS:-100%,25%,10%}
ROUTING=${ROUTING:-uniform}
COMPARE=${COMPARE:-transformers,accelerate}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}
SEED=${SEED:-0}
WARMUP=${WARMUP:-1}
DEADLINE=${DEADLINE:-570}
export HOST_BUDGET_qwen3_30b_a3b=${HOST_BUDGET_qwen3_30b_a3b:-40%}
if [ -z "${TRACE:-}" ]; then
  TRACE=$(ls bench/traces/*.jsonl bench/traces/*.jsonl.gz 2>/dev/null | head -n 1 || true)
fi
LOG="$OUT/gpu_bench.log"

TAG=gpu_bench
source scripts/gpu_steps.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo none)"
log "disk: $(df -h "$MOETIER_HOME" 2>/dev/null | tail -n 1 || df -h / | tail -n 1)"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
python3 -c "import matplotlib" 2>/dev/null && PLOT=1 || PLOT=0
log "matplotlib: $([ $PLOT -eq 1 ] && echo present || echo absent, plots skipped)"
[ -n "$TRACE" ] && [ -f "$TRACE" ] && log "trace routing from $TRACE" || log "no trace file: trace routing skipped"

for shape in $SHAPES; do
  var="HOST_BUDGET_${shape//-/_}"
  host=${!var:-}
  if [ "$shape" = "qwen3-30b-a3b" ] && [ -n "$LAYERS" ] && [ "$LAYERS" -le 24 ]; then host=; fi
  layer_args=()
  [ -n "$LAYERS" ] && layer_args=(--layers "$LAYERS")
  host_args=()
  [ -n "$host" ] && host_args=(--host-budget "$host")
  routing=$ROUTING
  [ -n "$TRACE" ] && [ -f "$TRACE" ] && routing="$routing,trace:$TRACE"
  tag="$shape${LAYERS:+-L$LAYERS}"
  df -h "$MOETIER_HOME" 2>/dev/null | tail -n 1 | sed 's/^/    disk before: /' | tee -a "$LOG"
  if step "$tag-generate" python3 -m moetier bench synthetic "$shape" "${layer_args[@]}" \
      --seed "$SEED"; then
    plot_args=()
    [ $PLOT -eq 1 ] && plot_args=(--plot "$WORK")
    step "$tag-latency" python3 -m moetier -v bench latency --synthetic "$shape" \
      "${layer_args[@]}" "${host_args[@]}" --expert-budget "$BUDGETS" --routing "$routing" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" --warmup "$WARMUP" \
      --compare "$COMPARE" --accelerate-output-len 4 --no-progress \
      --save-result "$WORK/$tag.json" --save-trace "$WORK/$tag-trace.jsonl" "${plot_args[@]}"
    # the markdown table is the stdout part of the log (before any stderr noise, see the log)
    [ -f "$WORK/$tag.json" ] && python3 - "$WORK/$tag.json" >"$WORK/$tag.md" <<'PY'
import json, sys
from moetier.bench.report import latency_table
print(latency_table(json.load(open(sys.argv[1]))))
PY
  fi
  if [ "${KEEP_CHECKPOINTS:-0}" != 1 ]; then
    rm -rf "$MOETIER_HOME/synthetic/$shape-"*
    log "deleted the $shape checkpoint"
  fi
done

{
  echo "# moetier bench latency, $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
  echo
  echo "settings: SHAPES=$SHAPES LAYERS=${LAYERS:-real} BUDGETS=$BUDGETS ROUTING=$ROUTING"
  echo "TRACE=${TRACE:-none} INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN SEED=$SEED COMPARE=$COMPARE"
  for md in "$WORK"/*.md; do
    [ -f "$md" ] || continue
    echo
    echo "## $(basename "$md" .md)"
    echo
    cat "$md"
  done
} >"$OUT/summary.md"
tar czf "$OUT/bench-results.tar.gz" -C "$OUT" bench && rm -rf "$WORK"
log "done: $(ls -la "$OUT" | tail -n +2 | wc -l) entries in $OUT, $(du -sh "$OUT" | cut -f1)"
