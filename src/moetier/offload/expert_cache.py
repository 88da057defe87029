"""Device tier: a fixed pool of expert slots, filled on demand from the host tier.

Owns slot tensors, the key->slot map and the slot policy; implements ExpertProvider. Never reads
files itself (the host tier does) and never decides what to compute.
"""

from __future__ import annotations

import time

import torch

from moetier.offload.policy import make_policy
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.offload.transfer import TransferEngine
from moetier.offload.types import ExpertBatch, ExpertKey
from moetier.weights.experts import ExpertShape


class ExpertCache:
    """`num_slots` device slots of packed experts; misses are fetched on demand (LRU by default)."""

    def __init__(
        self,
        host: HostTier,
        shape: ExpertShape,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
        stats: OffloadStats,
        policy: str = "lru",
    ) -> None:
        self.host = host
        self.shape = shape
        self.device = device
        self.stats = stats
        self.num_slots = num_slots
        self.slots = torch.empty(num_slots, shape.numel, dtype=dtype, device=device)
        self.slot_of: dict[ExpertKey, int] = {}
        self.key_of: dict[int, ExpertKey] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.policy = make_policy(policy)
        self.transfer = TransferEngine(device)
        self.cuda = device.type == "cuda"
        self.slot_free_event: dict[int, torch.cuda.Event] = {}  # last compute use of a slot
        self._resident_table: torch.Tensor | None = None

    @property
    def intermediate(self) -> int:
        return self.shape.intermediate

    @property
    def pool(self) -> torch.Tensor:
        return self.slots

    @property
    def resident_table(self) -> torch.Tensor | None:
        return self._resident_table

    def count_resident(self, pairs: int) -> None:
        self.stats.count_device_calls(pairs)

    def count_routed(self, pairs: int, distinct: int) -> None:
        self.stats.count_host_call(pairs, distinct)

    def count_routing_sync(self, seconds: float) -> None:
        self.stats.routing_sync_s += seconds

    def freeze_resident(self, num_layers: int, num_experts: int) -> None:
        """Every routed expert holds a slot and nothing will be evicted: publish the [layer,
        expert] -> slot map on the device so MoE layers can look slots up without the host."""
        assert len(self.slot_of) == self.num_slots, "freeze_resident needs every expert loaded"
        table = torch.full((num_layers, num_experts), -1, dtype=torch.int32)
        for key, slot in self.slot_of.items():
            table[key.layer, key.expert] = slot
        self._resident_table = table.to(self.device)

    @property
    def max_batch(self) -> int:
        return self.num_slots

    @property
    def bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def fetch(self, layer: int, experts: list[int]) -> ExpertBatch:
        assert len(experts) <= self.num_slots, "caller must split experts into waves of max_batch"
        keys = [ExpertKey(layer, e) for e in experts]
        self.policy.begin_call(layer, experts)
        in_use = set(keys)
        events: list[torch.cuda.Event] = []
        slots: list[int] = []
        wait_start: torch.cuda.Event | None = None  # compute-stream mark at the first miss
        start = time.perf_counter()
        missed = False
        for key in keys:
            self.stats.requests += 1
            slot = self.slot_of.get(key)
            if slot is not None:
                self.stats.device_hits += 1
                self.policy.touch(key)
            else:
                if self.cuda and not missed:
                    # Marked before the load is issued, so host-side issue time and disk reads
                    # count as exposed when the compute stream has nothing queued to hide them.
                    wait_start = torch.cuda.Event(enable_timing=True)
                    wait_start.record(torch.cuda.current_stream(self.device))
                missed = True
                slot, event = self._load(key, in_use)
                if event is not None:
                    events.append(event)
            slots.append(slot)
        if missed:
            self.stats.miss_host_s += time.perf_counter() - start
        if wait_start is not None:
            self._wait_measured(wait_start, events)
        elif missed:
            self.stats.exposed_fetch_s += time.perf_counter() - start
        return ExpertBatch(layer, experts, slots, self.slots, self.shape.split)

    def release(self, batch: ExpertBatch) -> None:
        if not self.cuda:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for s in batch.slots:
            self.slot_free_event[s] = done

    def _load(self, key: ExpertKey, in_use: set[ExpertKey]) -> tuple[int, torch.cuda.Event | None]:
        slot = self._claim_slot(in_use)
        dst = self.slots[slot]
        src = self.host.lookup(key)
        try:  # a failed read (missing, truncated or unreadable shard) hands the slot back
            if src is not None:
                self.stats.host_hits += 1
                row = self.host.row_of(key)
            elif not self.cuda and not self.host.capacity:
                self.host.read_direct(key, dst)
                self._install(key, slot)
                return slot, None
            else:
                src, row = self.host.read(key)
        except BaseException:
            self.free.append(slot)
            raise
        event = self.transfer.copy(dst, src, after=self.slot_free_event.pop(slot, None))
        self.host.mark_in_flight(row, event)
        self.stats.bytes_host_to_device += src.numel() * src.element_size()
        self._install(key, slot)
        return slot, event

    def _install(self, key: ExpertKey, slot: int) -> None:
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.insert(key)

    def _claim_slot(self, in_use: set[ExpertKey]) -> int:
        if self.free:
            return self.free.pop()
        victim = self.policy.victim(exclude=in_use)
        self.policy.remove(victim)
        slot = self.slot_of.pop(victim)
        del self.key_of[slot]
        self.stats.evictions += 1
        return slot

    def _wait_measured(self, start: torch.cuda.Event, events: list[torch.cuda.Event]) -> None:
        """Compute stream waits for the loads; the time from `start` to the end is exposed."""
        stream = torch.cuda.current_stream(self.device)
        end = torch.cuda.Event(enable_timing=True)
        self.transfer.wait(events)
        end.record(stream)
        self.stats.add_exposed_events(start, end)

    def resident(self) -> list[ExpertKey]:
        """Resident keys, next victim first (for tests and debugging)."""
        return [k for k in self.policy.order() if k in self.slot_of]

    def check_integrity(self) -> None:
        assert len(self.slot_of) == len(self.key_of)
        for key, slot in self.slot_of.items():
            assert self.key_of[slot] == key
        assert not set(self.key_of) & set(self.free), "a used slot is also free"
        assert len(self.key_of) + len(self.free) == self.num_slots
