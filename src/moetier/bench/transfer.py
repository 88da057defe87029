"""Measures the expert transfer path: pinned host tier -> device slot through ExpertCache.

Builds a synthetic checkpoint with real expert shapes, fills the host tier, then times on-demand
misses (host hits) with CUDA events. Reports GB/s per expert copy and per-miss latency.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moetier.offload.expert_cache import ExpertCache
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout

SHAPES = {  # name: (hidden D, expert intermediate I)
    "qwen3-30b-a3b": (2048, 768),
    "deepseek-v2-lite": (2048, 1408),
    "olmoe-1b-7b": (2048, 1024),
}


def _synthetic(path: Path, hidden: int, inter: int, experts: int) -> ExpertLayout:
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden),
        "model.layers.0.mlp.experts.down_proj": torch.randn(experts, hidden, inter),
    }
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return ExpertLayout(Checkpoint(path), {0: ["model.layers.0.mlp"]}, experts)


def measure_shape(name: str, experts: int = 32, slots: int = 4) -> dict[str, Any]:
    hidden, inter = SHAPES[name]
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        layout = _synthetic(Path(tmp), hidden, inter, experts)
        stats = OffloadStats()
        host = HostTier(layout, experts, torch.bfloat16, True, stats, progress=False)
        cache = ExpertCache(host, slots, device, stats)
        nbytes = layout.shape.numel * 2
        copy_ms, miss_ms, issue_ms = [], [], []
        for i in range(experts * 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            batch = cache.fetch(0, [i % experts])  # always a miss: slots << experts, LRU
            issue_ms.append((time.perf_counter() - t0) * 1e3)
            end.record()
            cache.release(batch)
            torch.cuda.synchronize()
            miss_ms.append((time.perf_counter() - t0) * 1e3)
            copy_ms.append(start.elapsed_time(end))
        copy = statistics.median(copy_ms[experts:])  # skip warm-up
        return {
            "shape": name,
            "expert_bytes": nbytes,
            "median_copy_ms": copy,
            "copy_GBps": nbytes / (copy / 1e3) / 1e9,
            "median_miss_wall_ms": statistics.median(miss_ms[experts:]),
            "median_host_issue_ms": statistics.median(issue_ms[experts:]),
            "exposed_fetch_s_total": stats.to_dict()["exposed_fetch_s"],
            "misses": stats.requests - stats.device_hits,
        }


def measure_raw(nbytes: int, repeats: int = 20) -> float:
    """Plain pinned->device copy bandwidth in GB/s for `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return nbytes / (statistics.median(times[2:]) / 1e3) / 1e9
