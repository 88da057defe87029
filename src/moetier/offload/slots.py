"""Device expert slots as a state machine: which key each slot holds, its state and its pins.

Owns slot states, the key->slot map, the free list and pin counts; never touches tensors,
policies or transfers (expert_cache.py drives it). Plain Python, tested without CUDA.

    FREE --claim--> LOADING --all bytes issued (CUDA) / read done (CPU)--> READY
    LOADING | READY --evict / cancel / failed read--> FREE (or straight to LOADING for a new key)

A LOADING slot's bytes are on the way: a reader waits for its load (the cache promotes a queued
prefetch and makes the compute stream wait on its event). A READY slot may still carry a
`ready` event that the compute stream has not waited on yet. A pinned slot (pins > 0) belongs
to a wave being computed: it is never a victim and never cancelled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    state: SlotState = SlotState.FREE
    key: Any = None
    pins: int = 0
    load: Any = None  # the load in progress (LOADING only)
    ready: Any = None  # event a reader must wait for before reading (None: nothing to wait for)
    prefetched: bool = False  # filled by a prefetch that no fetch has used yet


class SlotTable:
    """`n` slots; slot ids are handed out lowest first."""

    def __init__(self, n: int) -> None:
        self.slots = [Slot() for _ in range(n)]
        self.slot_of: dict[Any, int] = {}
        self.free = list(range(n - 1, -1, -1))
        self._pinned: set[int] = set()
        self._loading: set[int] = set()
        self._by_layer: dict[Any, set[Any]] = {}  # key[0] (the layer) -> its keys in slots

    def __len__(self) -> int:
        return len(self.slots)

    def take_free(self) -> int | None:
        return self.free.pop() if self.free else None

    def assign(self, slot: int, key: Any, load: Any, prefetched: bool = False) -> None:
        """A claimed slot (taken from the free list, or vacated) starts loading `key`."""
        s = self.slots[slot]
        assert s.state is SlotState.FREE and slot not in self.free, f"slot {slot} is not claimed"
        assert key not in self.slot_of, f"{key} already holds slot {self.slot_of[key]}"
        s.state, s.key, s.load, s.ready = SlotState.LOADING, key, load, None
        s.prefetched = prefetched
        self.slot_of[key] = slot
        self._loading.add(slot)
        self._by_layer.setdefault(key[0], set()).add(key)

    def mark_ready(self, slot: int, event: Any = None) -> None:
        s = self.slots[slot]
        assert s.state is SlotState.LOADING, f"slot {slot} is {s.state.value}, not loading"
        s.state, s.load, s.ready = SlotState.READY, None, event
        self._loading.discard(slot)

    def vacate(self, slot: int) -> Any:
        """Empty an unpinned slot for reuse (not put on the free list); return its old key."""
        s = self.slots[slot]
        assert s.state is not SlotState.FREE, f"slot {slot} is already free"
        assert s.pins == 0, f"slot {slot} is pinned ({s.pins}): never a victim"
        key = s.key
        del self.slot_of[key]
        self._by_layer[key[0]].discard(key)
        self._loading.discard(slot)
        s.state, s.key, s.load, s.ready, s.prefetched = SlotState.FREE, None, None, None, False
        return key

    def give_back(self, slot: int) -> None:
        """Put a vacated or never-assigned claimed slot back on the free list."""
        assert self.slots[slot].state is SlotState.FREE and slot not in self.free
        self.free.append(slot)

    def pin(self, slot: int) -> None:
        s = self.slots[slot]
        assert s.state is not SlotState.FREE, f"pinning free slot {slot}"
        s.pins += 1
        self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        s = self.slots[slot]
        assert s.pins > 0, f"slot {slot} is not pinned"
        s.pins -= 1
        if not s.pins:
            self._pinned.discard(slot)

    def pinned_keys(self) -> set[Any]:
        return {self.slots[s].key for s in self._pinned}

    def loading_keys(self) -> set[Any]:
        return {self.slots[s].key for s in self._loading}

    def keys_of_layer(self, layer: Any) -> set[Any]:
        """Keys of `layer` holding a slot (a live view: copy before changing the table)."""
        return self._by_layer.get(layer, set())

    def loading_slots(self) -> list[int]:
        return sorted(self._loading)

    @property
    def num_pinned(self) -> int:
        return sum(s.pins for s in self.slots)

    def check(self, idle: bool = True) -> None:
        """States, keys, free list and pins agree; `idle` (between steps): nothing pinned."""
        free = set(self.free)
        assert len(free) == len(self.free), "a slot is on the free list twice"
        for i, s in enumerate(self.slots):
            if s.state is SlotState.FREE:
                assert i in free, f"slot {i} is free but not on the free list: leaked"
                assert s.key is None and s.load is None and not s.pins, (i, s)
                continue
            assert i not in free, f"slot {i} is {s.state.value} and on the free list"
            assert self.slot_of.get(s.key) == i, f"slot {i} holds {s.key} but the map disagrees"
            assert s.pins >= 0 and (s.pins > 0) == (i in self._pinned), (i, s.pins)
            assert (s.state is SlotState.LOADING) == (s.load is not None) == (i in self._loading)
            assert not (idle and s.pins), f"slot {i} ({s.key}) still pinned {s.pins}x"
        assert len(self.slot_of) + len(free) == len(self.slots), "slots leaked"
        by_layer = {k for keys in self._by_layer.values() for k in keys}
        assert by_layer == set(self.slot_of), "per-layer key sets disagree with the slot map"
