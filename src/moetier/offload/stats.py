"""Counters of the expert tiers: hits by tier, bytes moved, exposed fetch time.

Plain Python; metrics export and CLI summaries read `OffloadStats.to_dict()`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

_ROUTING = ("host", "device")
_KINDS = ("decode", "prefill")


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
    # Layer streaming (MoEBlock.stream_share): layer calls that touched nearly all of their
    # layer's experts (a long prompt, a large batch) and so prefetched every expert of the next
    # MoE layer; the loads that started are in prefetches_issued too.
    streamed_calls: int = 0
    prefetches_streamed: int = 0
    # Engine steps by kind: decode = every scheduled request adds one token and samples (the
    # rule of the CUDA-graph path); prefill = any prompt chunk, with or without decodes.
    decode_steps: int = 0
    prefill_steps: int = 0
    # Forwards replayed as CUDA graphs instead of launched from Python: decode steps
    # (engine/graphs.py, whole or piecewise) and fresh prompts (engine/prefill_graphs.py).
    decode_graph_replays: int = 0
    prefill_graph_replays: int = 0
    # MoE layer calls and their (token, expert) pairs before the per-step dedup across the batch
    # (the sum over the step's requests of the experts each asked for), by the kind of step and
    # by where routing was resolved. host: the routing ids went to the host (the layer's one
    # sync), so the call's distinct experts are known and counted too. device: the all-resident
    # slot table, no sync; the distinct count is not measured there (it would need a sync).
    moe_calls_host_decode: int = 0
    moe_calls_host_prefill: int = 0
    moe_calls_device_decode: int = 0
    moe_calls_device_prefill: int = 0
    token_lookups_host_decode: int = 0
    token_lookups_host_prefill: int = 0
    token_lookups_device_decode: int = 0
    token_lookups_device_prefill: int = 0
    distinct_lookups_host_decode: int = 0
    distinct_lookups_host_prefill: int = 0
    _decode: bool = False  # the kind of the engine step in progress (prefill outside steps)
    _pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def begin_step(self, decode: bool) -> None:
        """An engine step starts; MoE layer calls until `end_step` count under its kind."""
        self._decode = decode
        if decode:
            self.decode_steps += 1
        else:
            self.prefill_steps += 1

    def end_step(self) -> None:
        self._decode = False

    def count_host_call(self, pairs: int, distinct: int) -> None:
        """One MoE layer call routed on the host: `pairs` (token, expert) lookups asked for,
        `distinct` experts after the dedup. Integer adds only: it runs once per layer call."""
        if self._decode:
            self.moe_calls_host_decode += 1
            self.token_lookups_host_decode += pairs
            self.distinct_lookups_host_decode += distinct
        else:
            self.moe_calls_host_prefill += 1
            self.token_lookups_host_prefill += pairs
            self.distinct_lookups_host_prefill += distinct

    def count_device_calls(self, pairs: int, calls: int = 1, resident: bool = True) -> None:
        """`calls` MoE layer calls routed on the device (a CUDA-graph replay counts all its
        layers at once): `pairs` (token, expert) lookups, no host decision. `resident`: by the
        all-resident table (else by the device cache, whose hits and misses it counts itself)."""
        if resident:
            self.resident_lookups += pairs
        if self._decode:
            self.moe_calls_device_decode += calls
            self.token_lookups_device_decode += pairs
        else:
            self.moe_calls_device_prefill += calls
            self.token_lookups_device_prefill += pairs

    def save_counts(self) -> dict[str, int | float]:
        """Every counter's value, for `restore_counts` (graph capture runs uncounted forwards)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def restore_counts(self, saved: dict[str, int | float]) -> None:
        for name, value in saved.items():
            setattr(self, name, value)

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
        out["engine_steps"] = self.decode_steps + self.prefill_steps
        out["moe_calls"] = sum(out[f"moe_calls_{r}_{k}"] for r in _ROUTING for k in _KINDS)
        out["token_lookups"] = sum(out[f"token_lookups_{r}_{k}"] for r in _ROUTING for k in _KINDS)
        return out
