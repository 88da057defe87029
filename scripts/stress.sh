#!/usr/bin/env bash
# Longer reliability runs than CI: API fuzzing (>= 5,000 requests), load with disconnects
# (>= 500 concurrent streams, roomy and cramped KV), plus the fault, security, input,
# shutdown and start-up out-of-memory tests.
# Writes a markdown report: bench/results/<date>-stress-<device>.md (device: cpu unless
# MOETIER_TEST_DEVICE is set).
#   FUZZ=5000 CLIENTS=500 ROUNDS=2 scripts/stress.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
FUZZ=${FUZZ:-5000}
CLIENTS=${CLIENTS:-500}
ROUNDS=${ROUNDS:-2}
DEVICE=${MOETIER_TEST_DEVICE:-cpu}
OUT=${OUT:-bench/results/$(date -u +%Y-%m-%d)-stress-${DEVICE}.md}
RECORD=$(mktemp)
LOG=$(mktemp)
trap 'rm -f "$RECORD" "$LOG"' EXIT
export MOETIER_STRESS_RECORD=$RECORD MOETIER_FUZZ_EXAMPLES=$FUZZ MOETIER_LOAD_CLIENTS=$CLIENTS

start=$(date +%s)
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider tests/reliability \
    -k "fuzz or hostile or faults or security or inputs or shutdown or startup_oom" 2>&1 | tee -a "$LOG" || status=$?
for round in $(seq 1 "$ROUNDS"); do
    # Each round a different client count, so a different random plan of who leaves when.
    MOETIER_LOAD_CLIENTS=$((CLIENTS + round - 1)) .venv/bin/python -m pytest -q \
        -p no:cacheprovider tests/reliability/test_load_disconnect.py 2>&1 | tee -a "$LOG" \
        || status=$?
done
elapsed=$(( $(date +%s) - start ))

.venv/bin/python - "$RECORD" "$LOG" "$OUT" "$elapsed" "$status" "$DEVICE" <<'PY'
import json, platform, re, subprocess, sys
record, log, out, elapsed, status, device = sys.argv[1:]
rows = [json.loads(line) for line in open(record)]
summary = [l for l in open(log).read().splitlines() if re.search(r"\d+ (passed|failed)", l)]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
lines = [
    f"# Stress run ({device}) — scripts/stress.sh",
    "",
    f"commit {commit}, {platform.platform()}, {elapsed} s wall, pytest exit "
    f"{'0 (all held)' if status == '0' else status}",
    "",
    "## API fuzzing (tests/reliability/test_fuzz_api.py)",
    "",
    "| requests | by status | 5xx | seconds |",
    "|---:|---|---:|---:|",
]
for r in rows:
    if r["test"] == "fuzz":
        by = ", ".join(f"{k}: {v}" for k, v in sorted(r["status"].items()))
        fivexx = sum(v for k, v in r["status"].items() if k.startswith("5"))
        lines.append(f"| {r['requests']} | {by} | {fivexx} | {r['seconds']:.1f} |")
lines += [
    "",
    "## Load with disconnects (tests/reliability/test_load_disconnect.py)",
    "",
    "| server | clients | left mid-stream | completed | completed != reference | "
    "KV blocks used after | preemptions | seconds |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
]
for r in rows:
    if r["test"].startswith("load"):
        lines.append(
            f"| {r['test'][5:]} | {r['clients']} | {r['disconnected']} | {r['completed']} | "
            f"{r['mismatched']} | {r['kv_blocks_used_after']:.0f} | {r['preemptions']:.0f} | "
            f"{r['seconds']:.1f} |"
        )
lines += ["", "## pytest summaries", "", "```", *summary, "```", ""]
open(out, "w").write("\n".join(lines))
print(f"wrote {out}")
PY
exit "$status"
