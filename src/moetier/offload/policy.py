"""Replacement policies for expert slots: small pure-Python classes behind a registry.

A policy only orders keys; it never touches tensors. Testable on recorded traces.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from moetier.errors import ConfigError


class Policy:
    """Tracks resident keys and picks an eviction victim among them."""

    def insert(self, key: Any) -> None:
        raise NotImplementedError

    def touch(self, key: Any) -> None:
        raise NotImplementedError

    def remove(self, key: Any) -> None:
        raise NotImplementedError

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        raise NotImplementedError

    def order(self) -> list[Any]:
        """Resident keys in eviction order as of now (next victim first)."""
        raise NotImplementedError


class LRUPolicy(Policy):
    """Evicts the least recently used key."""

    def __init__(self) -> None:
        self._order: OrderedDict[Any, None] = OrderedDict()

    def insert(self, key: Any) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Any) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Any) -> None:
        del self._order[key]

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        for key in self._order:
            if key not in exclude:
                return key
        raise RuntimeError("no evictable key: every resident key is in use")

    def order(self) -> list[Any]:
        """Keys from next victim to most recently used."""
        return list(self._order)


class LFUPolicy(Policy):
    """Evicts the key used least often since it was inserted; ties go to the least recent."""

    def __init__(self) -> None:
        self._count: dict[Any, int] = {}
        self._recency: OrderedDict[Any, None] = OrderedDict()

    def insert(self, key: Any) -> None:
        self._count[key] = 1
        self._recency[key] = None
        self._recency.move_to_end(key)

    def touch(self, key: Any) -> None:
        self._count[key] += 1
        self._recency.move_to_end(key)

    def remove(self, key: Any) -> None:
        del self._count[key]
        del self._recency[key]

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        best, best_count = None, None
        for key in self._recency:  # least recent first, so ties keep the older key
            if key in exclude:
                continue
            if best_count is None or self._count[key] < best_count:
                best, best_count = key, self._count[key]
        if best is None:
            raise RuntimeError("no evictable key: every resident key is in use")
        return best

    def order(self) -> list[Any]:
        return sorted(self._recency, key=lambda k: self._count[k])  # stable: ties by recency


POLICIES: dict[str, Callable[[], Policy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown expert-cache policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
