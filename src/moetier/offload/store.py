"""Host tier of routed experts: a bounded pool of packed experts in RAM over the disk tier.

Owns host buffers (pinned once at load time when CUDA is used) and disk reads; never touches
device slots. With a capacity of every routed expert it preloads all of them at start.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from moetier.offload.policy import make_policy
from moetier.offload.stats import OffloadStats
from moetier.offload.types import ExpertKey
from moetier.weights.experts import ExpertLayout

log = logging.getLogger(__name__)


class HostTier:
    """Packed experts in host RAM, LRU-bounded to `capacity`; misses read the checkpoint."""

    def __init__(
        self,
        layout: ExpertLayout,
        capacity: int,
        dtype: torch.dtype,
        pin: bool,
        stats: OffloadStats,
        progress: bool = True,
    ) -> None:
        self.layout = layout
        self.stats = stats
        self.numel = layout.shape.numel
        self.total = len(layout.layers) * layout.num_experts
        self.capacity = min(capacity, self.total)
        # With no host capacity, two staging rows let a read overlap the previous copy.
        rows = self.capacity if self.capacity > 0 else 2
        self.pool = torch.empty(rows, self.numel, dtype=dtype, pin_memory=pin)
        self.index: dict[ExpertKey, int] = {}
        self.policy = make_policy("lru")
        self.free = list(range(rows))
        self.in_flight: dict[int, torch.cuda.Event] = {}  # row -> last async copy out of it
        self._next_staging = 0
        if self.capacity == self.total:
            self._preload(progress)

    @property
    def bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size() if self.capacity else 0

    def _preload(self, progress: bool) -> None:
        keys = [
            ExpertKey(la, e) for la in self.layout.layers for e in range(self.layout.num_experts)
        ]
        bar = tqdm(keys, desc="Loading experts into RAM", unit="expert", disable=not progress)
        for key in bar:
            row = self.free.pop()
            self.layout.read_into(key.layer, key.expert, self.pool[row])
            self.index[key] = row
            self.policy.insert(key)

    def lookup(self, key: ExpertKey) -> torch.Tensor | None:
        """The host copy of `key` if this tier holds it (counts nothing)."""
        row = self.index.get(key)
        if row is None:
            return None
        self.policy.touch(key)
        return self.pool[row]

    def read(self, key: ExpertKey) -> tuple[torch.Tensor, int]:
        """Read `key` from disk into a host row (kept if capacity allows); return (row, row_id)."""
        row = self._claim_row(key)
        self._wait_row(row)
        start = time.perf_counter()
        nbytes = self.layout.read_into(key.layer, key.expert, self.pool[row])
        self.stats.disk_read_s += time.perf_counter() - start
        self.stats.disk_reads += 1
        self.stats.bytes_disk_to_host += nbytes
        if self.capacity:
            self.index[key] = row
            self.policy.insert(key)
        return self.pool[row], row

    def read_direct(self, key: ExpertKey, out: torch.Tensor) -> None:
        """Read `key` from disk straight into a CPU slot (CPU compute device, no host copy)."""
        start = time.perf_counter()
        nbytes = self.layout.read_into(key.layer, key.expert, out)
        self.stats.disk_read_s += time.perf_counter() - start
        self.stats.disk_reads += 1
        self.stats.bytes_disk_to_host += nbytes

    def mark_in_flight(self, row: int, event: torch.cuda.Event | None) -> None:
        """An async copy reads host row `row` until `event` completes."""
        if event is not None:
            self.in_flight[row] = event

    def row_of(self, key: ExpertKey) -> int:
        return self.index[key]

    def _claim_row(self, key: ExpertKey) -> int:
        if not self.capacity:
            row = self._next_staging
            self._next_staging = (row + 1) % self.pool.shape[0]
            return row
        if self.free:
            return self.free.pop()
        victim = self.policy.victim()
        self.policy.remove(victim)
        self.stats.host_evictions += 1
        return self.index.pop(victim)

    def _wait_row(self, row: int) -> None:
        event = self.in_flight.pop(row, None)
        if event is not None:
            event.synchronize()  # rare: the row is still being copied to the device

    def check_integrity(self) -> None:
        rows = list(self.index.values())
        assert len(rows) == len(set(rows)), "two experts share a host row"
        assert len(rows) <= self.capacity
        assert not set(rows) & set(self.free), "a used host row is also free"
