"""Fresh prompts on the demo model (CPU, 100% expert budget): per prompt the TTFT and the wall
time spent inside SDPA calls (wrapped), one JSON line. The first prompt is a warm-up.

    python scripts/cpu_fresh_sdpa.py LABEL [TOKENS [REPS]]    # THREADS=2 for two torch threads

Used for bench/results/2026-12-07-cpu-fresh-causal.md (run it from two checkouts, interleaved).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moetier import LLM, SamplingParams  # noqa: E402
from moetier.demo import ensure_demo_model  # noqa: E402


def main() -> None:
    label = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1040
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    real = F.scaled_dot_product_attention
    acc = {"ms": 0.0, "calls": 0, "causal": 0}

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = time.perf_counter()
        out = real(*args, **kwargs)
        acc["ms"] += (time.perf_counter() - t) * 1e3
        acc["calls"] += 1
        acc["causal"] += bool(kwargs.get("is_causal"))
        return out

    F.scaled_dot_product_attention = timed  # type: ignore[assignment]
    llm = LLM(
        str(ensure_demo_model(progress=False)),
        expert_budget="100%",
        max_model_len=8192,
        enable_prefix_caching=False,
        progress=False,
        threads=int(os.environ.get("THREADS", "1")),
    )
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for r in range(reps + 1):
        ids = torch.randint(100, 40000, (tokens,), generator=g).tolist()
        acc.update(ms=0.0, calls=0, causal=0)
        t = time.perf_counter()
        llm.generate(ids, params)
        total = (time.perf_counter() - t) * 1e3
        if r:
            rows.append((total, acc["ms"], acc["calls"], acc["causal"]))
    print(
        json.dumps(
            {
                "label": label,
                "threads": torch.get_num_threads(),
                "total_ms": [round(x[0]) for x in rows],
                "sdpa_ms": [round(x[1]) for x in rows],
                "sdpa_calls": rows[0][2],
                "causal_calls": rows[0][3],
                "median_total": round(statistics.median(x[0] for x in rows)),
                "median_sdpa": round(statistics.median(x[1] for x in rows)),
            }
        )
    )


if __name__ == "__main__":
    main()
