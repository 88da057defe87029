#!/usr/bin/env bash
# One device call that checks and measures a session's work, from the repo root on the GPU
# machine, in priority order (each step logs and the script goes on when one fails; no step
# starts within 30 s of DEADLINE seconds):
#   1. the GPU test suite (tests/gpu);
#   2. DeepSeek-V2-Lite (27 layers) `bench latency` at 100 / 25 %, uniform and trace routing,
#      today's defaults (piecewise graphs); with PREFETCH=<predictor> the same with prefetch;
#      then 10 % with offloaded steps eager (piecewise_graphs=false; EAGER=0 skips it); then
#      batch 16 and 4 with every expert resident, today's hot path against the old one (slot
#      kernel, fused kernels and graphs off), for the hot-path issue's "no regression at batch
#      4 / 16".
#   3. the serving sweep: `bench serve` on the Qwen3-30B-A3B shape cut to SERVE_LAYERS layers,
#      25 % expert budget, 1 / 4 / 16 concurrent streams, SERVE_OUTPUT tokens each (needs the
#      server wheels in .whl-server: see ../.library/device/README.md); before it, the same
#      shape at 100 % (`bench latency`); SERVE_POLICY picks the server's policy (lru).
# Results under $OUT: gpu_tests.log, summary.md, session-results.tar.gz, gpu_session.log.
set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/session"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-570}
SERVE_LAYERS=${SERVE_LAYERS:-12}
SERVE_OUTPUT=${SERVE_OUTPUT:-32}
PREFETCH=${PREFETCH:-}
TRACE=${TRACE:-bench/traces/demo-128x8.jsonl.gz}
LOG="$OUT/gpu_session.log"
TAG=gpu_session
source scripts/gpu_steps.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/gpu}
cp "$WORK/gpu-tests.log" "$OUT/gpu_tests.log" 2>/dev/null

DS=(--synthetic deepseek-v2-lite)
if step ds-generate python3 -m moetier bench synthetic deepseek-v2-lite --seed 0; then
  latency ds-25 "${DS[@]}" --expert-budget 100%,25% --routing "${DS_ROUTING:-uniform,trace:$TRACE}"
  [ -n "$PREFETCH" ] && latency ds-25-prefetch "${DS[@]}" --expert-budget 100%,25% \
    --routing "uniform,trace:$TRACE" --set "prefetch=$PREFETCH"
  [ "${EAGER:-1}" = 1 ] && latency ds-eager "${DS[@]}" --expert-budget 10% \
    --routing "uniform,trace:$TRACE" --set "piecewise_graphs=false"
  # batch 4 and 16, every expert resident: today's hot path against the old one
  OLD="moe_slot_kernel_max_pairs=0 fused_kernels=false cuda_graphs=false"
  for b in 16 4; do
    latency "ds-b$b-new" "${DS[@]}" --expert-budget 100% --routing uniform --batch-size "$b"
    latency "ds-b$b-old" "${DS[@]}" --expert-budget 100% --routing uniform --batch-size "$b" \
      --set "$OLD"
  done
fi


if ls .whl-server/fastapi-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl-server/fastapi-*.whl .whl-server/starlette-*.whl .whl-server/uvicorn-*.whl \
    .whl-server/pydantic-2*.whl .whl-server/pydantic_core-*cp312*.whl \
    .whl-server/annotated_types-*.whl .whl-server/typing_inspection-*.whl \
    .whl-server/typing_extensions-*.whl .whl-server/opentelemetry_api-*.whl >>"$LOG" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
  if step q3-generate python3 -m moetier bench synthetic qwen3-30b-a3b --layers "$SERVE_LAYERS" \
      --seed 0; then
    Q3=$(ls -d "$MOETIER_HOME"/synthetic/qwen3-30b-a3b-L"$SERVE_LAYERS"-s0 | head -n 1)
    latency q3-100 --model "$Q3" --expert-budget 100% --routing uniform
    step serve-sweep python3 -m moetier bench serve --model "$Q3" --expert-budget 25% \
      --dtype bfloat16 --dataset random --input-len 128 --output-len "$SERVE_OUTPUT" \
      --num-prompts 16 --max-concurrency 1,4,16 --temperature 0 --seed 0 --server-timeout 240 --policy "${SERVE_POLICY:-lru}" \
      --server-log "$WORK/serve-server.log" --save-result "$WORK/serve-sweep.json" --no-progress
  fi
else
  log "no .whl-server wheels: serving sweep skipped"
fi

summarize "$OUT/gpu_tests.log"
