"""Belady's optimal expert-slot schedule on a routing trace, with the engine's slot semantics.

Owns the offline optimum only (no timing, no tensors). The semantics mirror the engine's
device tier: one global pool of S slots shared by all MoE layers; a layer call needs its
distinct experts (ascending) resident at once, split by the caller into waves of at most S;
a miss evicts a resident expert that is not part of the current wave. Belady evicts the one
whose next use lies farthest in the future (never used again first). Since all experts of a
wave are requested at the same moment, the wave is the unit of time; the farthest-next-use
rule is optimal for that problem too (tests check it against brute force).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from moetier.bench.trace import TraceRecord
from moetier.offload.policy import Policy

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class BeladyResult:
    requests: int  # expert lookups (distinct experts per layer call), counted steps only
    misses: int  # loads into a slot, counted steps only
    step_misses: dict[int, int] = field(default_factory=dict)  # step -> its misses (counted)

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.requests if self.requests else 1.0


def waves(records: Sequence[TraceRecord], num_slots: int) -> list[tuple[int, list[Key]]]:
    """(step, keys) per wave, in execution order: each call's distinct experts in chunks of S."""
    out: list[tuple[int, list[Key]]] = []
    for r in records:
        experts = r.distinct()
        for w0 in range(0, len(experts), num_slots):
            out.append((r.step, [(r.layer, e) for e in experts[w0 : w0 + num_slots]]))
    return out


def belady(
    records: Sequence[TraceRecord],
    num_slots: int,
    counted_steps: set[int] | None = None,
    initial: Sequence[Key] = (),
) -> BeladyResult:
    """Minimum number of slot loads for `records` with `num_slots` slots.

    `initial`: keys resident before the first record (at most S). Only waves whose step is in
    `counted_steps` (None: all) count toward the result; earlier steps still shape the state,
    which is how the simulation is warmed up like the engine was.
    """
    if num_slots < 1:
        raise ValueError("need at least one slot")
    sched = waves(records, num_slots)
    # next_use[i][j]: index of the next wave after i that needs sched[i][1][j] (inf if none)
    inf = len(sched)
    next_use: list[list[int]] = [[] for _ in sched]
    upcoming: dict[Key, int] = {}
    for i in range(len(sched) - 1, -1, -1):
        keys = sched[i][1]
        next_use[i] = [upcoming.get(k, inf) for k in keys]
        for k in keys:
            upcoming[k] = i
    resident: dict[Key, int] = {}  # key -> index of its next use (from the current time)
    heap: list[tuple[int, Key]] = []  # (-next use, key); stale entries skipped lazily
    for k in list(dict.fromkeys(initial))[:num_slots]:
        resident[k] = upcoming.get(k, inf)
        heapq.heappush(heap, (-resident[k], k))
    requests = misses = 0
    per_step: dict[int, int] = {}
    for i, (step, keys) in enumerate(sched):
        counted = counted_steps is None or step in counted_steps
        requests += len(keys) if counted else 0
        in_wave = set(keys)
        for k in keys:
            if k in resident:
                continue
            if counted:
                misses += 1
                per_step[step] = per_step.get(step, 0) + 1
            if len(resident) >= num_slots:
                _evict(resident, heap, in_wave)
            resident[k] = i  # placeholder; set to its next use below
        for k, nxt in zip(keys, next_use[i]):
            resident[k] = nxt
            heapq.heappush(heap, (-nxt, k))
    return BeladyResult(requests, misses, per_step)


def _evict(resident: dict[Key, int], heap: list[tuple[int, Key]], in_wave: set[Key]) -> None:
    """Remove the resident key outside the wave whose next use is farthest."""
    held: list[tuple[int, Key]] = []
    while heap:
        neg, k = heapq.heappop(heap)
        if resident.get(k) != -neg:
            continue  # stale: evicted, or its next use has moved
        if k in in_wave:
            held.append((neg, k))
            continue
        del resident[k]
        break
    else:
        raise AssertionError("no evictable slot: a wave is larger than the pool")
    for item in held:
        heapq.heappush(heap, item)


class BeladyPolicy(Policy):
    """Belady's rule as a policy, for `replay.simulate`: the victim is the resident key whose
    next use (wave index, `waves(records, num_slots)`) is farthest, never used again first.

    It knows the future: it must be replayed on exactly the records it was built from, one
    `begin_call` per wave in order (as `simulate` calls it). On demand loads alone it makes
    `belady`'s choices; with prefetches (a streamed next layer) its victims are still the
    farthest next uses, the rule an oracle would follow under the engine's streaming -- not a
    proven minimum then: `belady` (demand loads, no pinning by prefetch) bounds every schedule
    from below. Lazy max-heap: O(log n) per operation.
    """

    def __init__(self, records: Sequence[TraceRecord], num_slots: int) -> None:
        self._uses: dict[Key, list[int]] = {}
        for i, (_, keys) in enumerate(waves(records, num_slots)):
            for k in keys:
                self._uses.setdefault(k, []).append(i)
        self._wave = -1
        self._next: dict[Key, tuple[int, int]] = {}  # resident key -> (next use, tick)
        self._heap: list[tuple[int, int, Key]] = []  # (-next use, -tick, key)
        self._tick = 0

    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._wave += 1

    def _push(self, key: Key) -> None:
        uses = self._uses.get(key, [])
        j = bisect_right(uses, self._wave)
        nxt = uses[j] if j < len(uses) else 1 << 62
        self._tick += 1
        self._next[key] = (nxt, self._tick)
        heapq.heappush(self._heap, (-nxt, -self._tick, key))

    def insert(self, key: Key) -> None:
        self._push(key)

    def touch(self, key: Key) -> None:
        self._push(key)

    def remove(self, key: Key) -> None:
        del self._next[key]

    def victim(self, exclude: set | frozenset = frozenset()) -> Key:
        held = []
        found = None
        while self._heap:
            neg, negtick, k = self._heap[0]
            if self._next.get(k) != (-neg, -negtick):
                heapq.heappop(self._heap)
            elif k in exclude:
                held.append(heapq.heappop(self._heap))
            else:
                found = k
                break
        for entry in held:
            heapq.heappush(self._heap, entry)
        if found is None:
            raise RuntimeError("no evictable key: every resident key is in use")
        return found

    def order(self) -> list[Key]:
        return sorted(self._next, key=lambda k: (-self._next[k][0], -self._next[k][1]))
