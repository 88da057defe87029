"""offload/scan.py: wide calls (a long prompt, a large batch) evict the layers their scan has
already computed, latest first; narrow calls and a new step leave eviction to the policy."""

from __future__ import annotations

from moetier.offload.expert_cache import ExpertCache
from moetier.offload.scan import ScanOrder
from moetier.offload.types import ExpertKey
from tests.unit.test_slots import _cache, _spy_victims, layout  # noqa: F401 (fixture)


def test_scan_order_tracks_one_scan() -> None:
    scan = ScanOrder(min_experts=3)
    by_layer = {0: {ExpertKey(0, 2), ExpertKey(0, 1)}, 1: {ExpertKey(1, 0)}, 2: set()}
    scan.observe(0, 3)
    assert scan.victim(by_layer.get, set()) is None  # nothing passed yet
    scan.observe(1, 4)
    scan.observe(2, 3)
    assert scan.layers == [0, 1, 2]
    assert scan.victim(by_layer.get, set()) == ExpertKey(1, 0)  # latest passed layer first
    assert scan.victim(by_layer.get, {ExpertKey(1, 0)}) == ExpertKey(0, 1)  # then the one before
    scan.observe(0, 3)  # the next step starts lower: a new scan
    assert scan.layers == [0]
    scan.observe(1, 2)  # a narrow call ends the scan
    assert scan.layers == [] and scan.victim(by_layer.get, set()) is None
    off = ScanOrder()
    off.observe(0, 100)
    assert off.layers == []


def _two_steps(cache: ExpertCache) -> set[ExpertKey]:
    for layer in (0, 1):  # step 1 fills the 6 slots
        cache.release(cache.fetch(layer, [0, 1, 2]))
    before = set(cache.slot_of)
    cache.release(cache.fetch(0, [0, 1, 3]))  # step 2
    cache.release(cache.fetch(1, [1, 2, 3]))
    cache.check_integrity()
    return before - set(cache.slot_of)  # the keys step 2 evicted


def test_wide_calls_evict_the_passed_layer(layout) -> None:  # noqa: F811
    lru = _cache(layout, slots=6, host_rows=0)
    assert _two_steps(lru) == {ExpertKey(0, 2), ExpertKey(1, 0)}  # LRU: layer 1's own key
    scan = _cache(layout, slots=6, host_rows=0)
    scan.scan.min_experts = 3
    spied = _spy_victims(scan)
    # layer 0 of step 2 has no passed layer: the policy picks (0, 2); layer 1 takes layer 0's
    # lowest unpinned key instead of its own least recent (1, 0), needed next step
    assert _two_steps(scan) == {ExpertKey(0, 2), ExpertKey(0, 0)}
    assert spied == [ExpertKey(0, 2)]  # the policy was asked once: (0, 0) is the scan's
