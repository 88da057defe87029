# Sourced by the GPU scripts (gpu_bench.sh, gpu_session.sh): timestamped logging and deadline-
# bounded steps. Needs START (=$SECONDS at the start), DEADLINE (seconds), LOG, WORK and TAG.

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
