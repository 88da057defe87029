#!/usr/bin/env bash
# GPU checks, run on the CUDA machine from the repo root: GPU parity tests and the transfer
# benchmark. Writes logs and JSON under $OUT (or ./gpu-results when OUT is unset).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/transfer.json"
import json, torch
from moetier.bench.transfer import SHAPES, measure_raw, measure_shape
print(json.dumps({
    "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    "raw_pinned_h2d_GBps": {str(n): round(measure_raw(n), 2) for n in (256 << 10, 16 << 20)},
    "expert_path": [measure_shape(s) for s in SHAPES],
}, indent=1))
PY
python3 -m moetier.bench.synthetic --shape qwen3-30b-a3b --layers 4 --compare-loop \
  --out "$OUT/decode-qwen3-30b-shape-4layers.json" > "$OUT/decode.log" 2>&1 || echo "decode bench failed"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
exit "${PIPESTATUS[0]}"
