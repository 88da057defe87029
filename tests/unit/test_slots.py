"""Device slot states and pins, and prefetch through the expert cache, on the CPU.

A fake copier stands in for the CUDA copy stream: it copies at once but reports each copy's
event complete only when the test says so, and records which events the compute "stream" was
made to wait on. Victim sequences, states and prefetch counters are exact.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.offload.expert_cache import ExpertCache
from moetier.offload.slots import SlotState, SlotTable
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.offload.transfer import PREFETCH
from moetier.offload.types import ExpertKey
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout
from tests.models.families import MICRO_MIXTRAL
from tests.models.parity import make_checkpoint

CPU = torch.device("cpu")
K = ExpertKey
K_1 = (K(1, 0), K(1, 1))


class Event:
    def __init__(self) -> None:
        self.done = False


class FakeCopier:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.waited: list[Event] = []

    def copy(self, chunks: Any, after: Any) -> Event:
        for dst, src in chunks:
            dst.copy_(src)
        self.events.append(Event())
        return self.events[-1]

    def query(self, event: Any) -> bool:
        return event is None or event.done

    def wait(self, event: Any) -> None:
        self.waited.append(event)

    def synchronize(self, event: Any) -> None:
        event.done = True

    def complete_all(self) -> None:
        for ev in self.events:
            ev.done = True


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> ExpertLayout:
    path: Path = make_checkpoint(tmp_path_factory.mktemp("slots"), "mixtral", **MICRO_MIXTRAL)
    prefixes = {i: [f"model.layers.{i}.block_sparse_moe"] for i in range(2)}
    return ExpertLayout(Checkpoint(path), prefixes, num_experts=4)


def _cache(
    layout: ExpertLayout, slots: int, host_rows: int, copier: Any = None, io_threads: int = 2
) -> ExpertCache:
    stats = OffloadStats()
    host = HostTier(layout, host_rows, torch.float32, False, stats, progress=False)
    return ExpertCache(host, slots, CPU, stats, copier=copier, io_threads=io_threads)


def _spy_victims(cache: ExpertCache) -> list[ExpertKey]:
    victims: list[ExpertKey] = []
    real = cache.policy.victim

    def spy(exclude: Any = frozenset()) -> Any:
        victims.append(real(exclude))
        return victims[-1]

    cache.policy.victim = spy  # type: ignore[method-assign]
    return victims


def _expert(layout: ExpertLayout, key: ExpertKey) -> torch.Tensor:
    out = torch.empty(layout.shape.numel)
    layout.read_into(key.layer, key.expert, out)
    return out


def test_slot_table_state_machine() -> None:
    t = SlotTable(2)
    a = t.take_free()
    assert a == 0
    t.assign(a, "x", load=object())
    assert t.slots[a].state is SlotState.LOADING and t.loading_keys() == {"x"}
    t.pin(a)
    t.check(idle=False)
    with pytest.raises(AssertionError, match="still pinned"):
        t.check(idle=True)
    with pytest.raises(AssertionError, match="pinned"):
        t.vacate(a)
    t.mark_ready(a, event="ev")
    assert t.slots[a].state is SlotState.READY and t.slots[a].ready == "ev"
    t.unpin(a)
    t.check()
    assert t.vacate(a) == "x" and t.slots[a].state is SlotState.FREE
    with pytest.raises(AssertionError, match="leaked"):
        t.check()
    t.give_back(a)
    t.check()
    assert t.take_free() == 0


def test_pinned_slots_are_never_victims(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=3, host_rows=0)
    victims = _spy_victims(cache)
    held = cache.fetch(0, [0])  # pinned: the least recently used key, but in use
    for e in (1, 2):
        cache.release(cache.fetch(0, [e]))
    cache.release(cache.fetch(0, [3]))
    cache.release(cache.fetch(1, [0]))
    assert victims == [K(0, 1), K(0, 2)]
    cache.check_integrity(idle=False)
    with pytest.raises(AssertionError, match="still pinned"):
        cache.check_integrity()
    cache.release(held)
    cache.release(cache.fetch(1, [1]))
    assert victims == [K(0, 1), K(0, 2), K(0, 0)]
    cache.check_integrity()
    # a prefetch never takes a pinned slot either
    batch = cache.fetch(1, [0, 1])
    cache.release(cache.fetch(0, [3]))
    held2 = cache.fetch(0, [3])
    assert cache.prefetch(0, [2]) == 0  # every resident key is pinned
    cache.release(batch)
    cache.release(held2)
    cache.check_integrity()


def test_hit_on_a_loading_slot_waits_for_its_event(layout: ExpertLayout) -> None:
    copier = FakeCopier()
    cache = _cache(layout, slots=3, host_rows=8, copier=copier)  # host tier holds every expert
    assert cache.prefetch(1, [2, 3]) == 2
    # (1,2): its one chunk is on the "stream" (issued, event pending); (1,3) waits behind it
    assert cache.slot_state(K(1, 2)) is SlotState.READY
    assert cache.slot_state(K(1, 3)) is SlotState.LOADING
    assert len(copier.events) == 1
    batch = cache.fetch(1, [3])  # a hit: promoted past nothing, issued now, waited on
    assert cache.slot_state(K(1, 3)) is SlotState.READY
    assert copier.waited == [copier.events[1]] and not copier.events[1].done
    assert torch.equal(batch.pool[batch.slots[0]], _expert(layout, K(1, 3)))
    s = cache.stats
    assert (s.requests, s.device_hits, s.prefetches_used, s.prefetches_in_time) == (1, 1, 1, 0)
    assert s.exposed_fetch_s > 0  # it had to wait
    cache.release(batch)
    cache.check_integrity()


@pytest.mark.parametrize("copy_now", [False, True])
def test_streamed_prefetch_copies_at_once_with_stream_copy_now(
    layout: ExpertLayout, copy_now: bool
) -> None:
    """A streamed step's next-layer prefetch: through the pump, one chunk on the "stream" and
    the rest queued; with `stream_copy_now`, every copy issued at once, whole. A guess (not
    streamed) is queued either way."""
    copier = FakeCopier()
    cache = _cache(layout, slots=4, host_rows=8, copier=copier)
    cache.stream_copy_now = copy_now
    assert cache.prefetch(0, [0], streamed=False) == 1
    assert len(copier.events) == 1 and cache.transfer.pending() == 0
    copier.complete_all()
    assert cache.prefetch(1, [0, 1, 2], streamed=True) == 3
    assert len(copier.events) == (4 if copy_now else 2)
    assert cache.transfer.pending() == (0 if copy_now else 2)
    states = [cache.slot_state(K(1, e)) for e in range(3)]
    loading = [SlotState.LOADING] * 2
    assert states == ([SlotState.READY] * 3 if copy_now else [SlotState.READY, *loading])
    s = cache.stats
    assert (s.prefetches_issued, s.bytes_host_to_device) == (
        4,
        (4 if copy_now else 2) * cache.expert_bytes,
    )
    batch = cache.fetch(1, [0, 1, 2])  # hits either way, the same bytes in the same slots
    for i, e in enumerate(batch.experts):
        assert torch.equal(batch.pool[batch.slots[i]], _expert(layout, K(1, e)))
    cache.release(batch)
    cache.check_integrity()


def test_prefetch_accounting_exact(layout: ExpertLayout) -> None:
    copier = FakeCopier()
    cache = _cache(layout, slots=3, host_rows=8, copier=copier)
    victims = _spy_victims(cache)
    nbytes = cache.expert_bytes
    cache.release(cache.fetch(0, [0, 1]))
    copier.complete_all()
    assert cache.prefetch(1, [2, 3]) == 2  # (1,2) takes the free slot, (1,3) evicts (0,0)
    cache.release(cache.fetch(1, [2]))  # used, but its copy had not completed: not in time
    # layer 1's call is over: (1,3), still queued behind (1,2)'s chunk, is stale
    assert cache.prefetch(0, [2]) == 1
    assert cache.slot_state(K(1, 3)) is SlotState.FREE
    cache.transfer.pump()
    copier.complete_all()
    cache.transfer.pump()
    copier.complete_all()
    cache.release(cache.fetch(0, [2]))  # complete before it was needed: in time
    assert cache.prefetch(1, [1]) == 1  # evicts (0,1)
    cache.transfer.pump()
    copier.complete_all()
    cache.release(cache.fetch(1, [0, 3, 2]))  # evicts (0,2) and the never-used (1,1)
    assert victims == [K(0, 0), K(0, 1), K(0, 2), K(1, 1)]
    s = cache.stats
    got = (
        s.prefetches_issued,
        s.prefetches_used,
        s.prefetches_in_time,
        s.prefetches_cancelled,
        s.prefetch_wasted_bytes,
    )
    assert got == (4, 2, 1, 1, nbytes)
    assert s.evictions == 4
    d = s.to_dict()
    assert d["prefetches_issued"] == 4 and d["prefetch_wasted_bytes"] == nbytes
    cache.check_integrity()


def test_prefetch_never_evicts_a_key_of_its_own_layer(layout: ExpertLayout) -> None:
    copier = FakeCopier()
    cache = _cache(layout, slots=3, host_rows=8, copier=copier)
    victims = _spy_victims(cache)
    cache.release(cache.fetch(1, [0]))  # the least recently used key, but of layer 1
    cache.release(cache.fetch(0, [1, 2]))
    assert cache.prefetch(1, [3]) == 1
    assert victims == [K(0, 1)]
    assert cache.prefetch(1, [2, 1]) == 1  # (0,2) goes; then only layer-1 keys are left
    assert victims == [K(0, 1), K(0, 2)]
    assert set(cache.slot_of) == {K(1, 0), K(1, 3), K(1, 2)}
    cache.check_integrity()


def test_prefetch_never_cancels_another_prefetch(layout: ExpertLayout) -> None:
    copier = FakeCopier()
    cache = _cache(layout, slots=2, host_rows=8, copier=copier)
    assert cache.prefetch(1, [0, 1, 2]) == 2  # two slots; the third would cancel a load
    assert cache.slot_state(K(1, 0)) is SlotState.READY  # issued, its event pending
    assert cache.table.loading_keys() == {K(1, 1)}  # queued behind it
    assert set(cache.slot_of) == {K(1, 0), K(1, 1)}
    assert cache.stats.prefetches_cancelled == 0
    cache.check_integrity()


def test_urgent_miss_cancels_a_queued_prefetch_it_evicts(layout: ExpertLayout) -> None:
    copier = FakeCopier()
    cache = _cache(layout, slots=2, host_rows=8, copier=copier)
    victims = _spy_victims(cache)
    cache.release(cache.fetch(0, [0]))
    assert cache.prefetch(1, [1]) == 1  # its chunk is on the stream (window: 1)
    assert cache.prefetch(1, [2]) == 1  # evicts (0,0); its copy waits in the queue
    assert cache.slot_state(K(1, 2)) is SlotState.LOADING
    issued = len(copier.events)
    batch = cache.fetch(0, [3, 0])  # two misses: the LRU victims are the prefetches
    assert victims == [K(0, 0), K(1, 1), K(1, 2)]
    assert cache.stats.prefetches_cancelled == 1  # (1,2) was still queued
    assert cache.stats.prefetch_wasted_bytes == cache.expert_bytes  # (1,1) moved, never used
    assert len(copier.events) == issued + 2  # the misses' copies; (1,2) never issued
    for slot, key in zip(batch.slots, (K(0, 3), K(0, 0))):
        assert torch.equal(batch.pool[slot], _expert(layout, key))
    cache.release(batch)
    cache.check_integrity()


def test_disk_prefetch_reads_in_the_background(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=4, host_rows=0)  # CPU, no host tier: reads go into slots
    assert cache.prefetch(1, [3, 1]) == 2
    jobs = [cache.table.slots[cache.slot_of[K(1, e)]].load.read for e in (3, 1)]
    deadline = time.monotonic() + 10.0
    while not all(j.done for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.001)
    batch = cache.fetch(1, [1, 3])
    for slot, key in zip(batch.slots, (K(1, 1), K(1, 3))):
        assert torch.equal(batch.pool[slot], _expert(layout, key))
    s = cache.stats
    assert (s.disk_reads, s.device_hits, s.prefetches_used, s.prefetches_in_time) == (2, 2, 2, 2)
    assert s.exposed_fetch_s == 0.0
    cache.release(batch)
    cache.check_integrity()


def test_on_demand_disk_read_overtakes_queued_prefetch_reads(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=4, host_rows=0, io_threads=1)
    order: list[ExpertKey] = []
    real = cache.host.read_into
    gate = threading.Event()

    def spy(key: ExpertKey, out: torch.Tensor) -> tuple[int, float]:
        order.append(key)
        return real(key, out)

    cache.host.read_into = spy  # type: ignore[method-assign]
    blocker = cache.reads.submit(lambda: gate.wait(10.0), PREFETCH)  # the only thread is busy
    while blocker.state != "running":
        time.sleep(0.001)
    assert cache.prefetch(1, [0, 1]) == 2
    assert cache.reads.queued() == [K(1, 0), K(1, 1)]
    batch = cache.fetch(0, [2])  # on demand: ahead of both queued prefetch reads
    assert order == [K(0, 2)]
    assert torch.equal(batch.pool[batch.slots[0]], _expert(layout, K(0, 2)))
    cache.release(batch)
    gate.set()
    batch = cache.fetch(1, [1])
    # the waiter runs (1,1) itself if the freed thread has not taken it yet; (1,0) may not
    # have been read yet: nothing waits for it
    assert order[0] == K(0, 2) and K(1, 1) in order[1:] and set(order) <= {K(0, 2), *K_1}
    assert torch.equal(batch.pool[batch.slots[0]], _expert(layout, K(1, 1)))
    cache.release(batch)
    cache.check_integrity()


def test_failed_read_hands_back_its_slot_and_unpins_the_wave(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=3, host_rows=0)
    real = cache.host.read_into

    def flaky(key: ExpertKey, out: torch.Tensor) -> tuple[int, float]:
        if key == K(1, 2):
            raise OSError(5, "Input/output error", "model.safetensors")
        return real(key, out)

    cache.host.read_into = flaky  # type: ignore[method-assign]
    cache.release(cache.fetch(1, [0]))
    with pytest.raises(OSError, match="Input/output error"):
        cache.fetch(1, [0, 2, 3])
    assert K(1, 2) not in cache.slot_of and {K(1, 0), K(1, 3)} <= set(cache.slot_of)
    cache.check_integrity()  # no pins left, the failed slot is free
    assert cache.prefetch(1, [2]) == 1  # a failed prefetch read hands its slot back quietly
    deadline = time.monotonic() + 10.0
    while cache.table.loading_slots() and time.monotonic() < deadline:
        cache.prefetch(0, [])  # any call moves prefetches on
        cache._advance()
    assert K(1, 2) not in cache.slot_of and cache.stats.prefetches_cancelled == 1
    cache.check_integrity()


def test_a_lone_miss_is_read_on_the_fetching_thread(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=4, host_rows=0)
    readers: dict[ExpertKey, str] = {}
    real = cache.host.read_into

    def spy(key: ExpertKey, out: torch.Tensor) -> tuple[int, float]:
        readers[key] = threading.current_thread().name
        return real(key, out)

    cache.host.read_into = spy  # type: ignore[method-assign]
    main = threading.current_thread().name
    cache.release(cache.fetch(0, [1]))
    assert readers == {K(0, 1): main}  # no hand-off to a read thread
    batch = cache.fetch(1, [0, 1, 2])  # the first read here, the others on the read threads
    assert readers[K(1, 0)] == main and set(readers) == {K(0, 1), K(1, 0), K(1, 1), K(1, 2)}
    for slot, key in zip(batch.slots, (K(1, 0), K(1, 1), K(1, 2))):
        assert torch.equal(batch.pool[slot], _expert(layout, key))
    cache.release(batch)
    cache.check_integrity()
