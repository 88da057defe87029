"""Counters of the expert tiers: hits by tier, bytes moved, exposed fetch time.

Plain Python; metrics export and CLI summaries read `OffloadStats.to_dict()`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class OffloadStats:
    """Running totals since the engine started (or since `reset()`)."""

    requests: int = 0  # expert lookups (one per distinct expert per layer per step)
    device_hits: int = 0  # found in a device slot
    host_hits: int = 0  # not in a slot, found in the host tier
    disk_reads: int = 0  # read from the checkpoint files at run time
    # (token, expert) lookups served by the all-resident device table without a host decision;
    # they are device hits by construction and are not in `requests`.
    resident_lookups: int = 0
    evictions: int = 0  # device slots overwritten
    host_evictions: int = 0
    bytes_disk_to_host: int = 0
    bytes_host_to_device: int = 0
    exposed_fetch_s: float = 0.0  # time compute waited for expert data
    disk_read_s: float = 0.0
    # Host wall time: handling misses in fetch (bookkeeping, reads, issuing copies), and waiting
    # at the MoE layers' routing syncs. Neither is in exposed_fetch_s, which is device time;
    # with misses, the sync also drains the GPU queue, so launch time is no longer hidden.
    miss_host_s: float = 0.0
    routing_sync_s: float = 0.0
    # Prefetch (ExpertCache.prefetch): loads started on a guess; used = a fetch needed the key
    # before it was evicted; in time = its bytes were already complete then (CUDA: the event
    # had completed, asked without a sync); cancelled = dropped before complete (stale, its
    # slot taken by a miss, or its read failed); wasted bytes = bytes moved into slots (or read
    # into CPU slots) for prefetches never used.
    prefetches_issued: int = 0
    prefetches_used: int = 0
    prefetches_in_time: int = 0
    prefetches_cancelled: int = 0
    prefetch_wasted_bytes: int = 0
    _pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def add_exposed_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Record a CUDA wait measured by two compute-stream events; resolved lazily."""
        self._pending.append((start, end))
        if len(self._pending) > 4096:
            self.resolve()

    def resolve(self) -> None:
        """Fold pending CUDA event pairs into exposed_fetch_s (synchronizes on the last one)."""
        for start, end in self._pending:
            end.synchronize()
            self.exposed_fetch_s += start.elapsed_time(end) / 1000.0
        self._pending.clear()

    def reset(self) -> None:
        self.resolve()
        for name, value in asdict(self).items():
            if not name.startswith("_"):
                setattr(self, name, type(value)())

    def to_dict(self) -> dict[str, float]:
        self.resolve()
        out: dict[str, float] = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        lookups = max(self.requests, 1)
        out["device_hit_rate"] = (
            self.device_hits / lookups if self.requests or not self.resident_lookups else 1.0
        )
        out["host_hit_rate"] = self.host_hits / lookups
        out["disk_read_rate"] = self.disk_reads / lookups
        return out
