"""Late reads (CPU, no host tier): a fetch returns while its misses are still read; `ready(i)`
waits for one, `release` settles the rest and hands back the slot of a failed read. Reads are
held on events here, so the test decides when each one finishes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from moetier.offload.expert_cache import ExpertCache
from moetier.offload.slots import SlotState
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.offload.types import ExpertKey
from moetier.weights.experts import ExpertLayout
from tests.unit.test_slots import _expert, layout  # noqa: F401  (the fixture)

K = ExpertKey
CPU = torch.device("cpu")


class HeldReads:
    """Wraps the host tier's read: a key in `held` waits for its event; records the thread."""

    def __init__(
        self, cache: ExpertCache, held: set[ExpertKey], fail: frozenset[ExpertKey] = frozenset()
    ) -> None:
        self.real = cache.host.read_into
        self.gates = {key: threading.Event() for key in held}
        self.fail = set(fail)
        self.thread: dict[ExpertKey, str] = {}
        cache.host.read_into = self  # type: ignore[method-assign]

    def __call__(self, key: ExpertKey, out: torch.Tensor) -> Any:
        self.thread[key] = threading.current_thread().name
        if key in self.gates:
            assert self.gates[key].wait(10.0), f"{key} was never let go"
        if key in self.fail:
            raise OSError(5, "Input/output error", "model.safetensors")
        return self.real(key, out)

    def started(self, *keys: ExpertKey) -> None:
        """Wait until each of `keys` has begun its read (on whichever thread)."""
        deadline = time.monotonic() + 10.0
        while not set(keys) <= self.thread.keys():
            assert time.monotonic() < deadline, f"reads of {keys} never started"
            time.sleep(0.001)

    def let_go(self, *keys: ExpertKey) -> None:
        for key in keys or tuple(self.gates):
            self.gates[key].set()


def _cache(layout: ExpertLayout, slots: int = 4, late: bool = True) -> ExpertCache:  # noqa: F811
    stats = OffloadStats()
    host = HostTier(layout, 0, torch.float32, False, stats, progress=False)
    return ExpertCache(host, slots, CPU, stats, late_reads=late)


def test_fetch_returns_before_its_misses_are_read(layout: ExpertLayout) -> None:  # noqa: F811
    cache = _cache(layout)
    cache.release(cache.fetch(1, [0]))
    reads = HeldReads(cache, held={K(1, 2), K(1, 3)})
    batch = cache.fetch(1, [0, 2, 3])  # would hang here if the misses were read before return
    assert batch.compute_order() == [0, 1, 2] and sorted(batch.late) == [1, 2]
    assert [cache.slot_state(K(1, e)) for e in (0, 2, 3)] == [
        SlotState.READY,
        SlotState.LOADING,
        SlotState.LOADING,
    ]
    batch.ready(0)  # in place: returns at once
    reads.started(K(1, 2), K(1, 3))  # both on the read threads, held there
    reads.let_go(K(1, 3))
    batch.ready(2)
    assert cache.slot_state(K(1, 3)) is SlotState.READY and 2 not in batch.late
    assert torch.equal(batch.pool[batch.slots[2]], _expert(layout, K(1, 3)))
    reads.let_go(K(1, 2))
    batch.ready_all()
    assert torch.equal(batch.pool[batch.slots[1]], _expert(layout, K(1, 2)))
    main = threading.current_thread().name
    assert reads.thread[K(1, 2)] != main and reads.thread[K(1, 3)] != main  # on read threads
    cache.release(batch)
    cache.check_integrity()
    assert cache.stats.requests == 4 and cache.stats.device_hits == 1


def test_with_nothing_in_place_the_first_read_runs_on_the_caller(layout: ExpertLayout) -> None:  # noqa: F811
    cache = _cache(layout)
    reads = HeldReads(cache, held={K(0, 2)})
    batch = cache.fetch(0, [1, 2])
    assert sorted(batch.late) == [0, 1] and batch.compute_order() == [0, 1]
    reads.started(K(0, 2))  # handed to a read thread at once, held there
    assert K(0, 1) not in reads.thread  # kept for the caller
    batch.ready(0)
    reads.let_go()
    batch.ready(1)
    assert reads.thread[K(0, 1)] == threading.current_thread().name
    assert reads.thread[K(0, 2)] != threading.current_thread().name
    cache.release(batch)
    cache.check_integrity()


def test_a_failed_late_read_raises_at_ready_and_its_slot_goes_back(layout: ExpertLayout) -> None:  # noqa: F811
    cache = _cache(layout)
    cache.release(cache.fetch(1, [0]))
    reads = HeldReads(cache, held=set(), fail=frozenset({K(1, 2)}))
    batch = cache.fetch(1, [0, 2, 3])
    with pytest.raises(OSError, match="Input/output error"):
        batch.ready(1)
    cache.release(batch)  # settles 3, unpins, hands back 2's slot
    assert K(1, 2) not in cache.slot_of and cache.slot_state(K(1, 3)) is SlotState.READY
    assert len(cache.table.free) == 2 and reads.thread.keys() >= {K(1, 2), K(1, 3)}
    cache.check_integrity()
    reads.fail = set()
    batch = cache.fetch(1, [2])  # the key can be fetched again once the disk reads work
    batch.ready_all()
    assert torch.equal(batch.pool[batch.slots[0]], _expert(layout, K(1, 2)))
    cache.release(batch)
    cache.check_integrity()


def test_release_settles_reads_nobody_waited_for(layout: ExpertLayout) -> None:  # noqa: F811
    cache = _cache(layout)
    cache.release(cache.fetch(0, [0]))
    reads = HeldReads(cache, held={K(0, 3)})
    batch = cache.fetch(0, [0, 3])
    threading.Timer(0.05, reads.let_go).start()
    cache.release(batch)  # the caller raised before waiting: release waits for the read
    assert cache.slot_state(K(0, 3)) is SlotState.READY
    assert torch.equal(cache.slots[cache.slot_of[K(0, 3)]], _expert(layout, K(0, 3)))
    cache.check_integrity()


def test_off_switch_and_other_tiers_read_before_fetch_returns(layout: ExpertLayout) -> None:  # noqa: F811
    cache = _cache(layout, late=False)
    batch = cache.fetch(0, [1, 2])
    assert batch.late == {} and cache.slot_state(K(0, 2)) is SlotState.READY
    cache.release(batch)
    stats = OffloadStats()
    host = HostTier(layout, 4, torch.float32, False, stats, progress=False)  # a host tier
    cache = ExpertCache(host, 4, CPU, stats, late_reads=True)
    assert not cache.late_reads
