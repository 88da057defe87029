"""Replaying a routing trace through the device-resident cache (offload/device_cache.py): the
same tensor ops the engine runs, on the CPU with one-element rows, so its policies' hit rates
sit beside the host policies' and Belady's on the same calls.

Batches: a batch of B is made as the bench's trace routing makes it (bench/routing_override.py)
— each layer's recorded token rows in order, B consecutive rows per step — so batch 16 here is
what `moetier bench latency --batch-size 16 --routing trace:...` feeds the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moetier.bench.belady import belady
from moetier.bench.replay import simulate
from moetier.bench.trace import RoutingTrace, TraceRecord
from moetier.offload.device_cache import DeviceCache
from moetier.offload.policy import make_policy
from moetier.offload.stats import OffloadStats


def batched(trace: RoutingTrace, batch: int) -> list[TraceRecord]:
    """The trace's calls regrouped into steps of `batch` tokens per layer (module doc); the
    steps that every layer can fill."""
    layers = trace.header.moe_layers or sorted({r.layer for r in trace.records})
    rows: dict[int, list[list[int]]] = {la: [] for la in layers}
    for r in trace.records:
        rows[r.layer].extend(r.experts)
    steps = min(len(v) for v in rows.values()) // batch
    return [
        TraceRecord(s, la, [0] * batch, rows[la][s * batch : (s + 1) * batch])
        for s in range(steps)
        for la in layers
    ]


def simulate_device(
    records: Sequence[TraceRecord], num_layers: int, num_experts: int, num_slots: int,
    policy: str = "lru",
) -> float:  # fmt: skip
    """Device-cache hit rate (hits over distinct-expert lookups) on `records`."""
    host = torch.zeros(num_layers * num_experts, 1)
    host_row = torch.arange(num_layers * num_experts).view(num_layers, num_experts)
    cache = DeviceCache(torch.zeros(num_slots, 1), host, host_row, num_experts, 4, policy)
    for r in records:
        cache.resolve(r.layer, torch.tensor(r.experts))
    stats = OffloadStats()
    cache.drain(stats)
    return stats.device_hits / max(stats.requests, 1)


def compare(
    trace: RoutingTrace, batch: int, share: float, device_policies: Sequence[str] = ("lru",),
    host_policies: Sequence[str] = ("lru",),
) -> dict[str, float]:  # fmt: skip
    """{name: hit rate} for Belady, the host policies and the device policies at a pool of
    `share` of all routed experts (at least one layer's experts)."""
    h = trace.header
    layers = max(h.moe_layers) + 1 if h.moe_layers else h.num_layers
    total = len(h.moe_layers) * h.num_experts
    slots = max(int(share * total), h.num_experts)
    records = batched(trace, batch) if batch > 1 else trace.records
    out = {"slots": float(slots), "belady": belady(records, slots).hit_rate}
    for name in host_policies:
        out[f"host-{name}"] = simulate(records, slots, make_policy(name)).hit_rate
    for name in device_policies:
        out[f"device-{name}"] = simulate_device(records, layers, h.num_experts, slots, name)
    return out
