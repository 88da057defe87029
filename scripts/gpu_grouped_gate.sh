#!/usr/bin/env bash
# Grouped MoE path vs per-expert loop on the GPU machine: two synthetic real shapes x two seeds,
# each budget run with both variants side by side. Writes one JSON per (shape, seed) under $OUT.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
for shape in ${SHAPES:-olmoe-1b-7b qwen3-30b-a3b}; do
  for seed in ${SEEDS:-0 1}; do
    python3 -m moetier.bench.synthetic --shape "$shape" --layers 4 --seed "$seed" \
      --budgets 100%,25%,10% --compare-loop \
      --out "$OUT/grouped-gate-$shape-seed$seed.json" > "$OUT/grouped-gate-$shape-seed$seed.log" 2>&1 \
      || echo "failed: $shape seed $seed (see log)"
    echo "done: $shape seed $seed"
  done
done
