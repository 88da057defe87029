"""Belady with the engine's slot semantics equals brute force on small random traces."""

from __future__ import annotations

import random
from functools import cache

import pytest

from moetier.bench.belady import Key, belady, waves
from moetier.bench.trace import TraceRecord


def brute_force(records: list[TraceRecord], slots: int, counted: set[int] | None) -> int:
    """Fewest counted loads over every demand-eviction choice (wave keys stay resident)."""
    sched = waves(records, slots)

    @cache
    def best(i: int, j: int, resident: frozenset[Key]) -> int:
        if i == len(sched):
            return 0
        step, keys = sched[i]
        if j == len(keys):
            return best(i + 1, 0, resident)
        key = keys[j]
        if key in resident:
            return best(i, j + 1, resident)
        cost = 1 if counted is None or step in counted else 0
        if len(resident) < slots:
            return cost + best(i, j + 1, resident | {key})
        wave = set(keys)
        options = [v for v in resident if v not in wave]
        return cost + min(best(i, j + 1, (resident - {v}) | {key}) for v in options)

    return best(0, 0, frozenset())


def random_records(rng: random.Random, calls: int, layers: int, experts: int, k: int):
    out = []
    for c in range(calls):
        tokens = rng.randint(1, 2)
        rows = [rng.sample(range(experts), k) for _ in range(tokens)]
        out.append(TraceRecord(c // layers, c % layers, [0] * tokens, rows))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_belady_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers, experts, k = rng.randint(1, 2), rng.randint(3, 5), rng.randint(1, 2)
    records = random_records(rng, rng.randint(3, 8), layers, experts, k)
    slots = rng.randint(k, min(4, layers * experts))
    counted = None if seed % 2 else {r.step for r in records if r.step >= 1}
    res = belady(records, slots, counted)
    assert res.misses == brute_force(records, slots, counted)


def test_waves_split_large_calls_and_count_lookups() -> None:
    rec = TraceRecord(0, 3, [0, 0], [[4, 1, 2], [2, 0, 5]])  # distinct 0 1 2 4 5
    assert waves([rec], 2) == [(0, [(3, 0), (3, 1)]), (0, [(3, 2), (3, 4)]), (0, [(3, 5)])]
    res = belady([rec], 2)
    assert (res.requests, res.misses) == (5, 5)


def test_belady_known_sequence() -> None:
    # one layer, 2 slots: calls need {0,1}, {2}, {0}, {1}: evicting 1 for 2 costs 2 more loads
    # later; evicting 0 too; optimal = 4 loads (0, 1, 2, then one of 0/1 again).
    recs = [TraceRecord(s, 0, [0], [row]) for s, row in enumerate([[0, 1], [2], [0], [1]])]
    assert belady(recs, 2).misses == 4
    assert belady(recs, 3).misses == 3
    assert belady(recs, 3, initial=[(0, 0), (0, 1), (0, 2)]).misses == 0
