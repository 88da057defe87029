"""Replacement policies: exact eviction order on hand-made access sequences."""

import pytest

from moetier.errors import ConfigError
from moetier.offload.policy import LFUPolicy, LRUPolicy, make_policy


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


def test_unknown_policy_lists_choices() -> None:
    with pytest.raises(ConfigError, match="lfu, lru"):
        make_policy("belady")
