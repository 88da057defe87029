"""Host cost of the expert cache's fetch path on the CPU: microseconds per lookup and per load
for decode-like calls (a few experts per layer, misses evicting) and streamed calls (every
expert of a layer, then the next layer prefetched), with the host tier holding every expert
(a load is a memcpy, so the Python bookkeeping shows). Runs on any commit's ExpertCache
(`stream_eviction` passed only where it exists). Usage, from the repository root:

    HF_HUB_OFFLINE=1 PYTHONPATH=src:. python scripts/miss_host_bench.py [stream_eviction]
"""

from __future__ import annotations

import inspect
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tests.models.parity import make_checkpoint

from moetier.offload.expert_cache import ExpertCache
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout

LAYERS, EXPERTS, TOP = 24, 32, 4
REPS = 15  # the minimum over repetitions: robust to other work on a shared machine
MICRO = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_local_experts=EXPERTS,
    num_experts_per_tok=TOP,
    vocab_size=32,
)


HAS_SWITCH = "stream_eviction" in inspect.signature(ExpertCache).parameters


def cache(layout: ExpertLayout, slots: int, stream_eviction: bool) -> ExpertCache:
    stats = OffloadStats()
    host = HostTier(layout, LAYERS * EXPERTS, torch.float32, False, stats, progress=False)
    kwargs = {}
    if HAS_SWITCH:
        kwargs["stream_eviction"] = stream_eviction
    return ExpertCache(host, slots, torch.device("cpu"), stats, **kwargs)  # type: ignore[arg-type]


def decode(c: ExpertCache, steps: int, seed: int) -> tuple[float, int, int]:
    rng = random.Random(seed)
    t = 0.0
    for _ in range(steps):
        for layer in range(LAYERS):
            experts = sorted(rng.sample(range(EXPERTS), TOP))
            t0 = time.perf_counter()
            c.release(c.fetch(layer, experts))
            t += time.perf_counter() - t0
    s = c.stats
    return t, s.requests, s.requests - s.device_hits


def streamed(c: ExpertCache, steps: int) -> tuple[float, int, int]:
    t = 0.0
    announce = hasattr(c, "streaming")
    for _ in range(steps):
        for layer in range(LAYERS):
            t0 = time.perf_counter()
            if announce:
                c.streaming(layer)
            batch = c.fetch(layer, list(range(EXPERTS)))
            if layer + 1 < LAYERS:
                c.prefetch(layer + 1, range(EXPERTS))
            c.release(batch)
            t += time.perf_counter() - t0
    s = c.stats
    return t, s.requests, s.requests - s.device_hits + s.prefetches_issued


def main() -> None:
    on = (sys.argv[1].lower() != "false") if len(sys.argv) > 1 else True
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), "mixtral", **MICRO)
        prefixes = {i: [f"model.layers.{i}.block_sparse_moe"] for i in range(LAYERS)}
        layout = ExpertLayout(Checkpoint(path), prefixes, num_experts=EXPERTS)
        slots = LAYERS * EXPERTS // 4
        rows = {"decode": [], "streamed": []}
        for rep in range(REPS):
            t, lookups, loads = decode(cache(layout, slots, on), 40, rep)
            rows["decode"].append((1e6 * t / lookups, 1e6 * t / max(loads, 1), loads))
            t, lookups, loads = streamed(cache(layout, slots, on), 6)
            rows["streamed"].append((1e6 * t / lookups, 1e6 * t / max(loads, 1), loads))
        label = f"stream_eviction={on}" if HAS_SWITCH else "(no stream_eviction)"
        for name, vals in rows.items():
            print(
                f"{name:<9} {label:<21}: {min(v[0] for v in vals):6.2f} us/lookup "
                f"{min(v[1] for v in vals):6.2f} us/load min, "
                f"{statistics.median(v[0] for v in vals):6.2f} us/lookup median "
                f"(loads {vals[0][2]}; {len(vals)} runs)"
            )


if __name__ == "__main__":
    main()
