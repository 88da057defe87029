"""Host tier of routed experts: a bounded pool of packed experts in RAM over the disk tier.

Owns host rows (page-locked once at load time when CUDA is used, exactly the budget: see
`alloc_host_rows`), which expert each row holds, and which rows a transfer still uses; never
touches device slots. With a capacity of every routed expert it preloads all of them at start.

Rows are claimed and installed on the caller's thread; only `read_into` (the disk read itself)
may run on a background thread, and it touches no bookkeeping.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
from typing import Any

import torch
from tqdm.auto import tqdm

from moetier.config import format_bytes
from moetier.offload.policy import make_policy
from moetier.offload.stats import OffloadStats
from moetier.offload.types import ExpertKey
from moetier.weights.experts import ExpertLayout

log = logging.getLogger(__name__)


def alloc_host_rows(
    rows: int, numel: int, dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, int]:
    """[rows, numel] host buffer and how many bytes of it are page-locked (exactly its size).

    `torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which
    rounds a block up to a power of two (a 40 GiB host tier would lock 64 GiB). Instead the rows
    live in anonymous page-aligned memory registered with `cudaHostRegister` (`LockedPages`);
    copies from it are truly asynchronous. PyTorch's `host_memory_stats()` does not count it.
    Falls back to `pin_memory=True` (logged) when registering fails.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = rows * numel * itemsize
    if not pin or nbytes == 0:
        return torch.empty(rows, numel, dtype=dtype), 0
    try:
        pages = LockedPages(nbytes)
    except Exception as exc:  # no CUDA binding, a failed mmap or registration
        log.warning(
            "page-locking %s of host tier with cudaHostRegister failed (%s); using "
            "pin_memory() (the caching host allocator may round it up to a power of two)",
            format_bytes(nbytes),
            exc,
        )
        return torch.empty(rows, numel, dtype=dtype, pin_memory=True), nbytes
    return pages.tensor(dtype).view(rows, numel), nbytes


class LockedPages(mmap.mmap):
    """Anonymous page-aligned host memory, registered with CUDA (page-locked) for exactly its
    size from creation until the last tensor over it is freed.

    Tensors come from `torch.frombuffer`, which keeps this object alive as long as their
    storage lives; the registration ends in `__del__`, after a device sync (no copy can still
    read the pages) and before the pages are unmapped, so a later allocation at the same
    address never meets a stale registration.
    """

    _ptr = 0

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer's note on buffers it does not own
            ptr = torch.frombuffer(self, dtype=torch.uint8).data_ptr()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister returned cudaError {err}")
        self._ptr = ptr

    def __new__(cls, nbytes: int) -> LockedPages:
        return super().__new__(cls, -1, nbytes)

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a flat tensor of `dtype` (keeps this object alive)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(self, dtype=dtype)

    def __del__(self) -> None:
        if not self._ptr:
            return
        ptr, self._ptr = self._ptr, 0
        try:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: CUDA may be gone; the process ends anyway
            pass


class HostTier:
    """Packed experts in host RAM, LRU-bounded to `capacity`; misses read the checkpoint.

    With capacity 0 it keeps two staging rows that hold an expert only while it is copied.
    A held row (a read into it, or a queued copy out of it, is pending) is never reclaimed.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        capacity: int,
        dtype: torch.dtype,  # the compute dtype
        pin: bool,
        stats: OffloadStats,
        progress: bool = True,
    ) -> None:
        self.layout = layout
        self.stats = stats
        self.packing = layout.packing(dtype)  # rows hold experts as stored (formats.py)
        self.numel = self.packing.numel
        self.total = layout.total
        self.capacity = min(capacity, self.total)
        # With no host capacity, two staging rows let a read overlap the previous copy.
        rows = self.capacity if self.capacity > 0 else 2
        self.pool, self.pinned_bytes = alloc_host_rows(
            rows, self.numel, self.packing.storage_dtype, pin
        )
        self._rows = self.pool.unbind(0)  # one view per row, made once (miss path: no indexing)
        self.index: dict[ExpertKey, int] = {}
        self.key_at: dict[int, ExpertKey] = {}
        self.policy = make_policy("lru")
        self.free = list(range(rows))
        self.in_flight: dict[int, Any] = {}  # row -> last async copy out of it
        self.held: dict[int, int] = {}  # row -> pending transfers using it
        self._next_staging = 0
        if self.capacity == self.total:
            self._preload(progress)

    @property
    def bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size() if self.capacity else 0

    def _preload(self, progress: bool) -> None:
        keys = [ExpertKey(la, e) for la, e in self.layout.owned()]
        bar = tqdm(keys, desc="Loading experts into RAM", unit="expert", disable=not progress)
        for key in bar:
            row = self.free.pop()
            self.layout.read_into(key.layer, key.expert, self.pool[row])
            self.install(key, row)

    def lookup(self, key: ExpertKey) -> int | None:
        """The row holding `key` if this tier holds it (counts nothing)."""
        row = self.index.get(key)
        if row is not None:
            self.policy.touch(key)
        return row

    def row(self, row: int) -> torch.Tensor:
        return self._rows[row]

    def claim_row(self, wait: bool = True) -> int | None:
        """A row to read an expert into, evicting the least recently used expert if needed.

        None when every row is held, or (wait=False) when the only candidates are still being
        copied out; with wait=True such a copy is waited for (a host sync, rare).
        """
        row = self._claim_staging(wait) if not self.capacity else self._claim_cached(wait)
        if row is not None and wait:
            self._wait_row(row)
        return row

    def _claim_staging(self, wait: bool) -> int | None:
        rows = self.pool.shape[0]
        for i in range(rows):
            row = (self._next_staging + i) % rows
            if row not in self.held and (wait or self._row_idle(row)):
                self._next_staging = (row + 1) % rows
                return row
        return None

    def _claim_cached(self, wait: bool) -> int | None:
        if self.free:
            return self.free.pop()
        exclude = {self.key_at[r] for r in self.held if r in self.key_at}
        try:
            victim = self.policy.victim(exclude=exclude)
        except RuntimeError:  # every row is held
            return None
        row = self.index[victim]
        if not wait and not self._row_idle(row):
            return None
        self.policy.remove(victim)
        del self.index[victim]
        del self.key_at[row]
        self.stats.host_evictions += 1
        return row

    def read_into(self, key: ExpertKey, out: torch.Tensor) -> tuple[int, float]:
        """Read `key` from disk into `out` (a host row or a CPU slot); (bytes, seconds).
        Thread-safe: touches no bookkeeping (the caller counts it with `count_read`)."""
        start = time.perf_counter()
        nbytes = self.layout.read_into(key.layer, key.expert, out)
        return nbytes, time.perf_counter() - start

    def count_read(self, nbytes: int, seconds: float) -> None:
        self.stats.disk_read_s += seconds
        self.stats.disk_reads += 1
        self.stats.bytes_disk_to_host += nbytes

    def install(self, key: ExpertKey, row: int) -> None:
        """`row` now holds `key` (read complete); kept if this tier has capacity."""
        if not self.capacity:
            return
        if key in self.index:  # read twice (a cancelled prefetch's read finished late)
            self.free.append(row)
            return
        self.index[key] = row
        self.key_at[row] = key
        self.policy.insert(key)

    def discard(self, row: int) -> None:
        """A claimed row whose read failed or was abandoned goes back, holding nothing."""
        if self.capacity and row not in self.key_at:
            self.free.append(row)

    def hold(self, row: int) -> None:
        self.held[row] = self.held.get(row, 0) + 1

    def unhold(self, row: int) -> None:
        n = self.held[row] - 1
        if n:
            self.held[row] = n
        else:
            del self.held[row]

    def mark_in_flight(self, row: int, event: Any | None) -> None:
        """An async copy reads host row `row` until `event` completes."""
        if event is not None:
            self.in_flight[row] = event

    def row_of(self, key: ExpertKey) -> int:
        return self.index[key]

    def _row_idle(self, row: int) -> bool:
        event = self.in_flight.get(row)
        return event is None or bool(event.query())

    def _wait_row(self, row: int) -> None:
        event = self.in_flight.pop(row, None)
        if event is not None:
            event.synchronize()  # rare: the row is still being copied to the device

    def check_integrity(self) -> None:
        rows = list(self.index.values())
        assert len(rows) == len(set(rows)), "two experts share a host row"
        assert len(rows) <= self.capacity
        assert not set(rows) & set(self.free), "a used host row is also free"
        assert all(self.key_at[r] == k for k, r in self.index.items()), "row map disagrees"
        assert len(self.key_at) == len(self.index)
        assert all(n > 0 for n in self.held.values())
