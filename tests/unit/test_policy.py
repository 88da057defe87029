"""Replacement policies: exact eviction order on hand-made access sequences."""

import random

import pytest

from moetier.errors import ConfigError
from moetier.offload.activation import ActivationPolicy
from moetier.offload.policy import (
    POLICIES,
    LeastStalePolicy,
    LFRUPolicy,
    LFUPolicy,
    LRUPolicy,
    make_policy,
)


def test_lru_evicts_least_recent_and_respects_exclude() -> None:
    p = LRUPolicy()
    for k in "abc":
        p.insert(k)
    p.touch("a")  # order now b, c, a
    assert p.order() == ["b", "c", "a"]
    assert p.victim() == "b"
    assert p.victim(exclude={"b"}) == "c"
    p.remove("b")
    p.insert("d")
    assert p.order() == ["c", "a", "d"]
    with pytest.raises(RuntimeError):
        p.victim(exclude={"a", "c", "d"})


def test_lfu_evicts_least_frequent_oldest_on_ties() -> None:
    p = LFUPolicy()
    for k in "abc":
        p.insert(k)
    p.touch("a")
    p.touch("a")
    p.touch("c")
    assert p.victim() == "b"  # counts a=3, b=1, c=2
    p.remove("b")
    p.insert("d")  # d=1
    assert p.victim() == "d"
    assert p.victim(exclude={"d"}) == "c"
    assert p.order() == ["d", "c", "a"]
    p.remove("d")
    p.insert("d")  # a count starts again at 1 after eviction
    p.touch("c")  # c=3 is now more recent than a=3
    assert p.order() == ["d", "a", "c"]


def _call(p: LeastStalePolicy | LFRUPolicy, layer: int, hits: str, loads: str) -> None:
    """One call of `layer`: touch the experts in `hits`, insert those in `loads` (digits)."""
    p.begin_call(layer, sorted(int(e) for e in hits + loads))
    for e in hits:
        p.touch((layer, int(e)))
    for e in loads:
        p.insert((layer, int(e)))


def test_least_stale_prefers_the_layer_just_visited_then_steps_unused() -> None:
    p = LeastStalePolicy()
    _call(p, 0, "", "01")
    _call(p, 1, "", "01")
    # layer 1 ran last: its next call is a whole step away, layer 0's is next
    assert p.order() == [(1, 0), (1, 1), (0, 0), (0, 1)]
    _call(p, 0, "0", "")
    # (0, 1) missed one visit of its layer; then layer 0 is now the stalest layer
    assert p.order() == [(0, 1), (0, 0), (1, 0), (1, 1)]
    assert p.victim(exclude={(0, 1)}) == (0, 0)
    p.begin_call(1, [2])
    assert p.order() == [(1, 0), (1, 1), (0, 1), (0, 0)]
    assert p.victim(exclude={(1, 0), (1, 2)}) == (1, 1)
    p.remove((1, 0))
    p.insert((1, 2))
    assert p.order() == [(1, 1), (0, 1), (1, 2), (0, 0)]


def test_layer_lru_evicts_within_a_layer_at_its_quota_else_from_the_fullest_layer() -> None:
    p, lru = make_policy("layer-lru"), make_policy("lru")
    for q in (p, lru):
        _call(q, 0, "", "01")
        _call(q, 1, "", "01")
        _call(q, 0, "0", "")
        q.begin_call(1, [2])
    # 4 keys over 2 layers: quota 2; layer 1 holds 2, so it gives up its own least recent key
    # where LRU would take layer 0's (0, 1)
    assert lru.victim(exclude={(1, 2)}) == (0, 1)
    assert p.victim(exclude={(1, 2)}) == (1, 0)
    assert p.order() == [(1, 0), (1, 1), (0, 1), (0, 0)]
    assert p.victim(exclude={(1, 0)}) == (1, 1)  # still its own layer first
    p.remove((1, 0))
    p.insert((1, 2))
    # a third layer arrives: quota 4 // 3 = 1, it holds none, so the victim comes from the
    # layer furthest over quota; both are 1 over: the one called most recently (layer 1)
    p.begin_call(2, [0])
    assert p.order() == [(1, 1), (1, 2), (0, 1), (0, 0)]
    assert p.victim() == (1, 1)
    p.remove((1, 1))
    p.insert((2, 0))
    # 4 // 3 = 1: layer 0 (2 keys) is over by 1, layers 1 and 2 (1 key each) are at quota
    p.begin_call(1, [3])
    assert p.victim(exclude={(1, 3)}) == (1, 2)  # layer 1 is at its quota: its own key
    p.begin_call(2, [1])
    assert p.victim(exclude={(2, 0), (2, 1)}) == (0, 1)  # own keys in use: the fullest layer


def test_lfru_keeps_the_frequent_key_over_the_recent_one_and_remembers_evicted_counts() -> None:
    p = LFRUPolicy()
    _call(p, 0, "", "01")
    for _ in range(3):
        _call(p, 0, "0", "")  # (0, 0) used 4 times, (0, 1) once
    _call(p, 0, "", "2")  # (0, 2) is the most recent, used once
    assert p.order() == [(0, 1), (0, 2), (0, 0)]
    p.remove((0, 0))
    _call(p, 0, "", "0")  # back with its decayed count of 4 plus this use
    assert p.order() == [(0, 1), (0, 2), (0, 0)]
    lru = LRUPolicy()
    for k in [(0, 1), (0, 2), (0, 0)]:
        lru.insert(k)
    assert lru.order() == p.order()  # same here; below, frequency wins over recency
    _call(p, 0, "1", "")
    assert p.order() == [(0, 2), (0, 1), (0, 0)]  # (0, 1): 2 uses, (0, 2): 1
    _call(p, 0, "2", "")
    _call(p, 0, "2", "")
    assert p.victim() == (0, 1)  # (0, 2) now has 3 uses; LRU would evict (0, 0)


def test_lfru_weights_toward_the_layer_just_visited() -> None:
    p = LFRUPolicy()
    _call(p, 0, "", "0")
    _call(p, 1, "", "0")
    _call(p, 0, "0", "")
    _call(p, 1, "0", "")
    assert p.order() == [(1, 0), (0, 0)]  # both used twice; layer 1 ran last
    _call(p, 0, "", "1")  # layer 0 runs without (0, 0): now it is the stalest of the two
    assert p.order() == [(0, 1), (0, 0), (1, 0)]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_victim_is_resident_not_excluded_and_first_in_order(name: str) -> None:
    rng = random.Random(name)
    p = make_policy(name)
    resident: set[tuple[int, int]] = set()
    for _ in range(200):
        for layer in range(3):
            wave = sorted(rng.sample(range(8), rng.choice((1, 2, 2, 4))))
            p.begin_call(layer, wave)
            keys = [(layer, e) for e in wave]
            for key in keys:
                if key in resident:
                    p.touch(key)
                    continue
                if len(resident) >= 6:
                    exclude = set(keys) | set(rng.sample(sorted(resident), 2))
                    victim = p.victim(exclude=exclude)
                    assert victim in resident and victim not in exclude
                    assert victim == next(k for k in p.order() if k not in exclude)
                    p.remove(victim)
                    resident.discard(victim)
                resident.add(key)
                p.insert(key)
            assert sorted(p.order()) == sorted(resident)
    with pytest.raises(RuntimeError, match="in use"):
        p.victim(exclude=resident)


def test_unknown_policy_lists_choices() -> None:
    names = "activation, hazard, layer-lru, least-stale, lfru, lfu, lru, step-lru"
    with pytest.raises(ConfigError, match=names):
        make_policy("belady")


def _act(p: ActivationPolicy, layer: int, hits: list[int], loads: list[int], req: int = 0) -> None:
    """One call of `layer` by one token of request `req` (routing given, as the replay does)."""
    ids = sorted(hits + loads)
    p.begin_call(layer, ids, [req], [ids])
    for e in hits:
        p.touch((layer, e))
    for e in loads:
        p.insert((layer, e))


def test_activation_learns_use_probabilities_and_weighs_layer_distance() -> None:
    p = ActivationPolicy()
    prob = p.probability
    _act(p, 0, [], [0])
    _act(p, 1, [], [0])
    # Nothing learned yet: every key at the 0.1 prior. Layer 1 ran last, so its key's next
    # call is 2 layer calls away against 1 for layer 0's: p / distance puts (1, 0) first.
    assert [prob(k) for k in [(0, 0), (1, 0)]] == [0.1, 0.1]
    assert p.order() == [(1, 0), (0, 0)]
    _act(p, 0, [0], [1])
    # Layer 0's call taught: the cell (0, 0) sat in (used 1 step ago, count ~1, need 1/9) was
    # used again, 1 of 1, so its age bucket says (1 + 0.1) / (1 + 1) = 0.55. (0, 0) is in a cell
    # not seen yet (count ~2, need 0.2): it gets its age bucket's 0.55; (0, 1) is in the cell
    # just learned: (1 + 0.55) / (1 + 1) = 0.775. (1, 0) keeps 0.1 and is 1 call away.
    assert [prob(k) for k in [(0, 0), (0, 1), (1, 0)]] == pytest.approx([0.55, 0.775, 0.1])
    assert p.order() == [(1, 0), (0, 0), (0, 1)]  # 0.1 / 1, 0.55 / 2, 0.775 / 2
    p.insert((1, 1))  # a prefetch (not layer 0's call): certain until layer 1 runs
    assert prob((1, 1)) == 1.0 and p.order()[-1] == (1, 1)
    assert p.victim(exclude={(1, 0)}) == (0, 0)
    _act(p, 1, [0, 1], [])
    # Layer 1's call: the learned cell is now 2 of 2 and age 1 is 2.1 of 3 = 0.7; (1, 0) is in
    # the unseen cell (0.7), (1, 1) in the learned one: (2 + 0.7) / (2 + 1) = 0.9.
    assert [prob(k) for k in [(1, 0), (1, 1)]] == pytest.approx([0.7, 0.9])
    assert p.order() == [(1, 0), (1, 1), (0, 0), (0, 1)]  # 0.35, 0.45, 0.55, 0.775
    assert p.victim(exclude={(1, 0), (1, 1)}) == (0, 0)


def test_activation_counts_a_call_once_and_feeds_finished_requests_to_the_library() -> None:
    p = ActivationPolicy()
    for req in (0, 1):  # one MoE layer; 4 steps of request 0, then 4 of request 1
        for _ in range(4):
            p.begin_call(0, [0, 1], [req, req], [[0], [1]])  # two tokens: experts 0 and 1
            p.begin_call(0, [2])  # a later wave of the same call: not counted again
    # Request 0 left the batch at request 1's first step: its matrix is the library's one
    # entry. Request 1 at layer 0: 8 tokens, own weight 8 / (8 + 8) on 4 / 8 per expert, the
    # library (request 0, the same) the rest; expert 2 (the wave's) was never counted.
    assert p.tracker.library_size == 1
    assert p.tracker.need(0, [1]).tolist() == [0.5, 0.5]
