#!/usr/bin/env bash
# One device call for the memory split's KV format (issue #23), from the repo root on the GPU
# machine: at one --gpu-memory GPU_MEMORY, bf16 vs int8 KV (KV_DTYPES), at batch 1 and 16
# (BATCHES), on the Qwen3-30B-A3B shape (SHAPE) cut to LAYERS (12) layers, trace routing
# (TRACE), --set "max_model_len=MAX_LEN (32768) max_num_seqs=MAX_SEQS (16)". Each `bench latency`
# runs the 100% reference, then one run whose expert slots and KV blocks the split decides:
# with int8 KV the request is about half and the split gives the bytes saved to expert slots.
# Results under $OUT: summary.md, kv-split-results.tar.gz, gpu_kv_split.log.
#
# GPU_MEMORY (default 18.25GiB) puts the experts at 25 % with bf16 KV. The split rule
# (src/moetier/engine/memory_split.py): remainder = gpu_memory - non-expert weights - reserve;
# the KV takes its request (max_num_seqs x max_model_len), the experts every whole slot left.
#   non-expert weights, bf16, 12 layers: 1,704,044,544 B
#     embeddings + lm_head (untied): 2 x 151,936 x 2,048 x 2 B       = 1,244,659,712
#     per layer: q 2,048x4,096 + k, v 2,048x512 + o 4,096x2,048, q/k norms 2 x 128, two layer
#     norms 2 x 2,048, router 128 x 2,048: 19,140,864 x 2 B = 38,281,728; x 12 = 459,380,736
#     final norm 2,048 x 2 B                                          =         4,096
#   reserve: 1,381,072,896 B
#     1 GiB + max_num_batched_tokens 4,096 x 16 x hidden 2,048 x 2 B (268,435,456)
#     + max_num_seqs 16 x vocab 151,936 x 16 B (38,895,616)
#   KV request, bf16: 16 x 32,768 tokens x 24,576 B (12 layers x 4 KV heads x 128 x 2 (K, V)
#     x 2 B)                                                          = 12,884,901,888
#   experts at 25 %: 384 of 1,536 slots x 9,437,184 B (3 x 2,048 x 768 x 2 B) = 3,623,878,656
#   sum 19,593,897,984 B = 18.248 GiB -> 18.25 GiB (19,595,788,288 B; the 1.9 MB over it is
#   under one slot, so bf16 gets exactly 384 slots and 32,772 KV blocks).
#   int8 KV: 12,672 B a token (12 x 4 x 2 x (128 + a 4-byte scale)), a request of
#   6,643,777,536 B: the split gives 1,045 slots (68 %, 9.86 GB) and 32,792 blocks (6.65 GB).
# (Checked against the H100 run of 2026-12-06, bench/results/2026-12-06-session10-h100.md: the
# same slot and block counts.) The budget is absolute, so the same split on an H100 or an H200.
#
# CPU dry run of the plumbing (no GPU; the tiny shape has 16 experts, the trace is folded):
#   SHAPE=tiny-qwen3 LAYERS=2 GPU_MEMORY=1100MiB MAX_LEN=256 OUT=/tmp/kvs bash scripts/gpu_kv_split.sh

# kv_split: the runs (needs gpu_steps.sh sourced; reads the variables above, each with its
# default). scripts/gpu_rows.sh KV_SPLIT=1 sources this file and calls it.
kv_split() {
  local shape=${SHAPE:-qwen3-30b-a3b} layers=${LAYERS:-12} b fmt
  local sets="max_model_len=${MAX_LEN:-32768} max_num_seqs=${MAX_SEQS:-16}"
  step kv-generate python3 -m moetier bench synthetic "$shape" --layers "$layers" --seed 0 ||
    return 1
  for b in ${BATCHES:-1 16}; do
    for fmt in ${KV_DTYPES:-bf16 int8}; do
      latency "kv-$fmt-b$b" --synthetic "$shape" --layers "$layers" \
        --routing "trace:${TRACE:-bench/traces/demo-128x8.jsonl.gz}" \
        --gpu-memory "${GPU_MEMORY:-18.25GiB}" --kv-cache-dtype "$fmt" --batch-size "$b" \
        --num-prompts "$b" --set "$sets"
    done
  done
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0 # sourced: the function only

set -uo pipefail
START=$SECONDS
OUT=${OUT:-gpu-results}
WORK="$OUT/kv-split"
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-540}
LOG="$OUT/gpu_kv_split.log"
TAG=gpu_kv_split
source scripts/gpu_steps.sh

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
kv_split
summarize "$WORK/kv-generate.log"
