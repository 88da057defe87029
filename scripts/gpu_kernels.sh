#!/usr/bin/env bash
# One device call for the expert kernels and prefill, from the repo root on the GPU machine:
#   1. the compressed-slot kernels' bandwidth (scripts/gpu_formats.py, with its launch-shape
#      sweep unless SWEEP=0) unless SKIP_FORMATS=1; with BEFORE=DIR first the same without the sweep on DIR's files
#      (a tree mirroring the repo's, swapped in: an A/B in one call);
#   2. SHAPE (qwen3-30b-a3b; LAYERS layers) with every expert resident, trace routing: TTFT
#      of a PROMPT-token prompt (64) with prefill graphs on and off (`bench latency`, 1
#      prompt, 8 new tokens) unless SKIP_PREFILL=1;
#   3. TPOT_FORMATS (e.g. "bf16 fp8 gguf-q4_k_m"): SHAPE synthetics per format, trace routing,
#      batch 1, the host path at the bytes bf16's 25% buys (fp8 50%, Q4_K_M 77%, Q4_K 89%,
#      Q8_0 47%: the README's bytes per expert), and with DC=1 the device cache (lru) too;
#   4. the GPU tests named in GPU_TESTS (pytest -k GPU_K) in the time left, or TEST_LIMIT s.
# PROBE="family ..." first runs scripts/gpu_family_probe.py on those families.
# Results under $OUT: kernels-results.tar.gz, summary.md, the log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/kernels"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-570}
SHAPE=${SHAPE:-qwen3-30b-a3b}
LAYERS=${LAYERS:-12}
PROMPT=${PROMPT:-64}
LOG="$OUT/gpu_kernels.log"
TAG=gpu_kernels
source scripts/gpu_steps.sh
source scripts/gpu_wheels.sh


log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
[ -n "${PROBE:-}" ] && step probe python3 scripts/gpu_family_probe.py $PROBE
if [ -n "${BEFORE:-}" ]; then
  swap_in
  mkdir -p "$WORK/before"
  step formats-before env OUT="$WORK/before" SWEEP=0 python3 scripts/gpu_formats.py
  swap_out
fi
[ "${SKIP_FORMATS:-0}" != 1 ] &&
  step formats env OUT="$WORK" SWEEP="${SWEEP:-1}" python3 scripts/gpu_formats.py
if [ "${SKIP_PREFILL:-0}" != 1 ]; then
  step generate python3 -m moetier bench synthetic "$SHAPE" --layers "$LAYERS" --seed 0
  S=(--synthetic "$SHAPE" --layers "$LAYERS" --expert-budget 100% --input-len "$PROMPT"
    --output-len 8 --seed 0 --warmup 1 --no-progress
    --routing "trace:${TRACE:-bench/traces/demo-128x8.jsonl.gz}")
  step "prefill-graphs-on" python3 -m moetier -v bench latency "${S[@]}" \
    --save-result "$WORK/prefill-on.json"
  step "prefill-graphs-off" python3 -m moetier -v bench latency "${S[@]}" \
    --set prefill_graphs=false --save-result "$WORK/prefill-off.json"
fi
for fmt in ${TPOT_FORMATS:-}; do
  budget=25%
  case $fmt in fp8) budget=50% ;; gguf-q4_k_m) budget=77% ;; gguf-q4_k) budget=89% ;;
    gguf-q8_0) budget=47% ;; esac
  tag="$SHAPE-L$LAYERS-$fmt"
  step "$tag-generate" python3 -m moetier bench synthetic "$SHAPE" --layers "$LAYERS" --seed 0 \
    --format "$fmt" || continue
  F=(--synthetic "$SHAPE" --layers "$LAYERS" --format "$fmt"
    --routing "trace:${TRACE:-bench/traces/demo-128x8.jsonl.gz}")
  latency "$tag-host" "${F[@]}" --expert-budget "$budget"
  [ "${DC:-0}" = 1 ] && latency "$tag-dc-lru" "${F[@]}" --expert-budget "$budget" \
    --set device_cache=true
done
if [ -n "${GPU_TESTS:-}" ]; then
  saved=$DEADLINE
  [ -n "${TEST_LIMIT:-}" ] && DEADLINE=$((SECONDS - START + TEST_LIMIT))
  step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rfE \
    --tb=short --junitxml="$OUT/gpu-junit.xml" ${GPU_K:+-k "$GPU_K"} $GPU_TESTS
  DEADLINE=$saved
fi
tar czf "$OUT/kernels-results.tar.gz" -C "$OUT" kernels
{
  echo "# gpu_kernels $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader)"
  for f in "$WORK"/before/formats.md "$WORK"/formats.md; do
    [ -f "$f" ] && { echo; echo "## $f"; cat "$f"; }
  done
  for f in "$WORK"/*.md; do
    case $f in */formats.md) continue ;; esac
    echo; echo "## $f"; grep -v "^    " "$f" | head -20
  done
  [ -f "$WORK/probe.log" ] && { echo; echo "## probe"; grep -v "Loading\|Writing" "$WORK/probe.log"; }
  for f in "$WORK"/prefill-*.json; do
    [ -f "$f" ] && python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["configs"]:
    print(sys.argv[1].split("/")[-1], {k: c.get(k) for k in (
        "budget", "ttft_ms", "tpot_ms", "prefill_graph_replays", "decode_graph_replays")})
PY
  done
  [ -f "$WORK/gpu-tests.log" ] && tail -n 60 "$WORK/gpu-tests.log"
} >"$OUT/summary.md" 2>&1
log done
