"""The `hazard` policy: exact probabilities and eviction order on hand-made sequences, and its
hits pinned on a short synthetic replay."""

from __future__ import annotations

import random

import pytest

from moetier.bench.belady import belady
from moetier.bench.replay import simulate
from moetier.offload.hazard import HazardPolicy
from moetier.offload.policy import make_policy
from tests.unit.test_policy_replay import _records


def _call(
    p: HazardPolicy, layer: int, experts: list[int], resident: set, req: int | None = None
) -> None:
    """One call of `layer` by one token (routing given when `req` is); misses inserted."""
    if req is None:
        p.begin_call(layer, experts)
    else:
        p.begin_call(layer, experts, [req], [experts])
    for e in experts:
        key = (layer, e)
        if key in resident:
            p.touch(key)
        else:
            p.insert(key)
            resident.add(key)


def test_hazard_learns_per_cell_and_weighs_layer_distance() -> None:
    p = HazardPolicy()
    prob = p.probability
    res: set = set()
    _call(p, 0, [0], res)
    _call(p, 1, [0], res)
    # Nothing learned: every cell at the 0.1 prior. Layer 1 ran last: its key's next call is 2
    # layer calls away (+ gap 0.3 x 2 layers) against 1 for layer 0's: 0.1/2.6 < 0.1/1.6.
    assert [prob(k) for k in [(0, 0), (1, 0)]] == [0.1, 0.1]
    assert p.order() == [(1, 0), (0, 0)]
    assert p.victim() == (1, 0)
    _call(p, 0, [1], res)
    # Layer 0's call: (0, 0) sat in the cell (age 1, count 1, own request, share 1/1) and was
    # not used: 0 of 1. (0, 1) now sits in that cell (share 1/2 is in the same top bucket):
    # coarse (0 + 0.05) / (1 + 0.5) = 1/30, fine (0 + 4/30) / (1 + 4) = 0.02667. (0, 0) moved
    # to age 2, a cell not seen yet: the prior 0.1.
    assert [prob(k) for k in [(0, 0), (0, 1)]] == pytest.approx([0.1, 0.4 / 15])
    assert p.order() == [(0, 1), (0, 0), (1, 0)]  # 0.0267/2.6, 0.1/2.6, 0.1/1.6
    p.insert((1, 5))  # a prefetch (not layer 1's call): certain until layer 1 runs
    assert prob((1, 5)) == 1.0 and p.order()[-1] == (1, 5)
    assert p.victim(exclude={(0, 1)}) == (0, 0)
    _call(p, 1, [1], res)
    # Layer 1's call: (1, 0) failed in the same cell, now 0 of 2: (1, 1) gets coarse
    # 0.05 / 2.5 = 0.02, fine 0.08 / 6. The prefetched (1, 5) was never used: the prior, and
    # it goes before (1, 0) on the tie (never used is older).
    assert [prob(k) for k in [(1, 1), (1, 5), (1, 0)]] == pytest.approx([0.08 / 6, 0.1, 0.1])
    assert p.order() == [(1, 1), (0, 1), (1, 5), (1, 0), (0, 0)]
    assert p.victim(exclude={(1, 1), (0, 1)}) == (1, 5)
    with pytest.raises(RuntimeError, match="in use"):
        p.victim(exclude=set(res) | {(1, 5)})


def test_hazard_keeps_the_hot_key_over_fresh_one_off_keys() -> None:
    p = HazardPolicy()
    res: set = set()
    for step in range(6):  # expert 0 every step, one new expert per step
        _call(p, 0, [0, step + 1], res)
    # LRU would order (0, 1) .. (0, 5), (0, 0), (0, 6). Here one-off keys were never reused:
    # every cell they sat in learned ~0 and the oldest cells' estimates fell below the fresh
    # key's; (0, 0), used 6 times, sits in a high-count cell that was always reused.
    assert p.order() == [(0, 5), (0, 4), (0, 3), (0, 1), (0, 2), (0, 6), (0, 0)]
    assert [round(p.probability(k), 4) for k in p.order()] == [
        0.0089,
        0.0114,
        0.016,
        0.0267,
        0.0267,
        0.1292,
        0.76,
    ]
    assert p.victim(exclude={(0, 5), (0, 4)}) == (0, 3)


@pytest.mark.parametrize("ids", [True, False])
def test_hazard_a_new_request_makes_the_old_requests_keys_unknown(ids: bool) -> None:
    p = HazardPolicy()
    res: set = set()
    for req, experts in [(0, [1, 2]), (0, [3, 4])] * 4 + [(1, [5, 6])]:
        _call(p, 0, experts, res, req if ids else None)
    # Request 0 reused every key 2 steps after its last use. At request 1's call (3, 4) are 2
    # steps old: as request 0's keys (ids given) they sit in a cell never seen (0.1); without
    # ids it is the same request's age-2 cell, 0.65. Age-1 keys were never reused: lowest.
    probs = [round(p.probability((0, e)), 4) for e in (5, 6, 1, 2, 3, 4)]
    if ids:
        assert probs == [0.0056, 0.0056, 0.1, 0.1, 0.1, 0.1]
    else:
        assert probs == [0.0111, 0.0111, 0.1, 0.1, 0.6492, 0.6492]
    assert p.order() == [(0, 5), (0, 6), (0, 1), (0, 2), (0, 3), (0, 4)]


def test_hazard_later_wave_of_a_call_is_not_counted_again() -> None:
    p = HazardPolicy()
    res: set = set()
    _call(p, 0, [0, 1], res, req=0)
    before = p.order(), [p.probability(k) for k in p.order()]
    p.begin_call(0, [2])  # a later wave of the same call: no learning, no rescoring
    assert (p.order(), [p.probability(k) for k in p.order()]) == before


def _synthetic(seed: int, steps: int = 200, layers: int = 3, experts: int = 16) -> list:
    """Requests of 40 steps, each with 3 hot experts per layer used w.p. 0.6 per token, the
    rest of the top-2 uniform: the traces' shape (recency, frequency, request changes)."""
    rng = random.Random(seed)
    calls = []
    hot: dict[int, list[int]] = {}
    for step in range(steps):
        if step % 40 == 0:
            hot = {la: rng.sample(range(experts), 3) for la in range(layers)}
        for layer in range(layers):
            used = {h for h in hot[layer] if rng.random() < 0.6}
            while len(used) < 2:
                used.add(rng.randrange(experts))
            calls.append((layer, sorted(used)[:3]))
    return calls


def test_hazard_replay_hits_on_a_synthetic_sequence() -> None:
    recs = _records(_synthetic(0))
    lookups = sum(len(r.distinct()) for r in recs)
    hits = {n: simulate(recs, 12, make_policy(n)).hits for n in ("lru", "activation", "hazard")}
    assert lookups == 1316
    assert lookups - belady(recs, 12).misses == 1089
    assert hits == {"lru": 958, "activation": 988, "hazard": 985}
