"""Hit rates of the device-resident cache's policies beside the host policies and Belady, on the
committed real-text traces, at batch 1 and 16 (bench/device_replay.py). CPU only, no model.

    python3 scripts/device_cache_replay.py --out bench/results/2026-12-04-device-cache-replay
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from moetier.bench.device_replay import compare
from moetier.bench.replay import load_trace


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--traces",
        default="bench/traces/demo-128x8.jsonl.gz,bench/traces/demo-64x6.jsonl.gz",
    )
    p.add_argument("--cases", default="1:0.25,1:0.10,16:0.25", help="batch:share,...")
    p.add_argument("--max-steps", type=int, default=2000, help="per case (batch-1 steps)")
    p.add_argument("--out", default=None, help="path stem for .json and .md")
    args = p.parse_args()
    rows = []
    for path in args.traces.split(","):
        trace = load_trace(path)
        keep = set(trace.steps()[: args.max_steps])
        trace.records = [r for r in trace.records if r.step in keep]
        for case in args.cases.split(","):
            batch, share = case.split(":")
            t0 = time.perf_counter()
            rates = compare(
                trace, int(batch), float(share), ("lru", "layer-lru"), ("lru", "layer-lru")
            )
            rows.append(dict(trace=Path(path).name, batch=int(batch), share=float(share),
                             seconds=round(time.perf_counter() - t0, 1), **rates))
            print(rows[-1], flush=True)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
        names = ["belady", "host-lru", "host-layer-lru", "device-lru", "device-layer-lru"]
        lines = ["| trace | batch | pool share (slots) | " + " | ".join(names) + " |",
                 "|---|---|---|" + "---|" * len(names)]
        for r in rows:
            cells = " | ".join(f"{r[n]:.3f}" for n in names)
            case = f"| {r['trace']} | {r['batch']} | {r['share']:.0%} ({int(r['slots'])})"
            lines.append(f"{case} | {cells} |")
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
