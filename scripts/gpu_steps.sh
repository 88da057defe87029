# Sourced by the GPU scripts (gpu_bench.sh, gpu_session.sh, gpu_memory.sh, gpu_gate.sh):
# timestamped logging, deadline-bounded steps and one `bench latency` run with its table. Needs
# START (=$SECONDS at the start), DEADLINE (seconds), LOG, WORK and TAG; sets the environment
# every GPU script runs with.

export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
export PYTHONUNBUFFERED=1
export MOETIER_HOME=${MOETIER_HOME:-/tmp/moetier-bench-home}

log() { echo "[$TAG $(date -u +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - (SECONDS - START))); }

# step NAME CMD...: run CMD with stdout+stderr to $WORK/NAME.log, killed at the deadline; no
# step starts with less than 30 s left.
step() {
  local name=$1 budget
  shift
  budget=$(left)
  if [ "$budget" -lt 30 ]; then
    log "skip $name: $budget s left before the deadline"
    return 1
  fi
  log "start $name (limit ${budget}s): $*"
  timeout -k 10 "$budget" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  log "end $name: rc=$rc$([ $rc -eq 124 ] && echo ' (deadline)')"
  tail -n 4 "$WORK/$name.log" | sed 's/^/    /' | tee -a "$LOG"
  return $rc
}

# latency NAME BENCH_ARGS...: batch-1 `bench latency` (64 in, 32 out, seed 0) saved as
# $WORK/NAME.json, its table as $WORK/NAME.md.
latency() {
  local name=$1
  shift
  step "$name" python3 -m moetier -v bench latency --input-len 64 --output-len 32 --seed 0 \
    --warmup 1 --no-progress --save-result "$WORK/$name.json" "$@"
  [ -f "$WORK/$name.json" ] && python3 - "$WORK/$name.json" >"$WORK/$name.md" <<'PY'
import json, sys
from moetier.bench.report import latency_table
print(latency_table(json.load(open(sys.argv[1]))))
PY
}

# summarize TESTS_LOG: $OUT/summary.md (the test log's last lines, then every $WORK/*.md table),
# then $WORK packed into $OUT/<name of WORK>-results.tar.gz.
summarize() {
  {
    echo "# $TAG $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
    tail -n 3 "$1" 2>/dev/null
    for md in "$WORK"/*.md; do
      [ -f "$md" ] || continue
      echo; echo "## $(basename "$md" .md)"; echo; cat "$md"
    done
  } >"$OUT/summary.md"
  tar czf "$OUT/$(basename "$WORK")-results.tar.gz" -C "$OUT" "$(basename "$WORK")" && rm -rf "$WORK"
  log "done"
}

# swap_in / swap_out: the files of the tree BEFORE (mirroring the repo's) swapped in for an A/B
# in one call, then back (each original kept aside as FILE.after meanwhile).
swap_in() { (cd "$BEFORE" && find . -type f) | while read -r f; do
  cp "$f" "$f.after" 2>/dev/null; cp "$BEFORE/$f" "$f"; done; }
swap_out() { (cd "$BEFORE" && find . -type f) | while read -r f; do mv "$f.after" "$f"; done; }
