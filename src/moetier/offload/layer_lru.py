"""The `layer-lru` expert-slot policy: per-layer slot quotas, LRU inside each layer.

A policy of the registry in `offload/policy.py` (pure Python, no tensors); the registry imports
it when asked for, as it does `activation`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from moetier.offload.policy import _NO_KEY, Policy


class LayerLRUPolicy(Policy):
    """Per-layer slot quotas with LRU inside each layer.

    Every MoE layer may keep quota = resident keys // MoE layers seen (at least 1). The victim
    is the least recently used key of the calling layer (the last `begin_call`) when that layer
    holds its quota or more; otherwise the least recently used key of the layer furthest over
    its quota (ties: the layer called most recently, whose next call is furthest away in the
    step's layer order). With one global pool this
    keeps a layer's working set from being pushed out by the other layers' newer keys, the LRU
    thrash when the pool is smaller than a step's working set, at O(1) per hit and O(layers)
    per eviction.
    """

    def __init__(self) -> None:
        self._keys: dict[int, OrderedDict[Any, int]] = {}  # layer -> key -> tick of last use
        self._tick = 0
        self._layer: int | None = None
        self._size = 0
        self._calls = 0
        self._visit: dict[int, int] = {}  # layer -> clock (calls) of its last call

    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._layer = layer
        self._keys.setdefault(layer, OrderedDict())
        self._calls += 1
        self._visit[layer] = self._calls

    def insert(self, key: Any) -> None:
        self._tick += 1
        self._keys.setdefault(key[0], OrderedDict())[key] = self._tick
        self._size += 1

    def touch(self, key: Any) -> None:
        self._tick += 1
        keys = self._keys[key[0]]
        keys[key] = self._tick
        keys.move_to_end(key)

    def remove(self, key: Any) -> None:
        del self._keys[key[0]][key]
        self._size -= 1

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        found = _layer_lru_victim(self._keys, self._visit, self._layer, self._quota(), exclude)
        if found is None:
            raise RuntimeError(_NO_KEY)
        return found

    def order(self) -> list[Any]:
        """Keys in eviction order as of now: the calling layer's, least recent first, when it
        holds its quota; then every other key by (quota - keys of its layer, last use)."""
        quota = self._quota()
        own = self._keys.get(self._layer) if self._layer is not None else None
        first = list(own) if own is not None and len(own) >= quota else []
        rest = [
            (quota - len(d), -self._visit.get(layer, 0), tick, key)
            for layer, d in self._keys.items()
            if d is not own or not first
            for key, tick in d.items()
        ]
        return first + [r[3] for r in sorted(rest, key=lambda r: r[:3])]

    def _quota(self) -> int:
        return max(1, self._size // max(1, len(self._keys)))


def _layer_lru_victim(
    keys: dict[int, OrderedDict[Any, int]],
    visit: dict[int, int],
    layer: int | None,
    quota: int,
    exclude: Any,
) -> Any:
    """`LayerLRUPolicy`'s victim: None when every key is excluded."""

    def oldest(d: OrderedDict[Any, int]) -> tuple[Any, int] | None:
        for key, tick in d.items():  # at most len(exclude) keys skipped
            if key not in exclude:
                return key, tick
        return None

    own = keys.get(layer) if layer is not None else None
    if own is not None and len(own) >= quota:
        found = oldest(own)
        if found is not None:
            return found[0]
    best: tuple[int, int, int, Any] | None = None  # (-excess, -last call, tick, key)
    for la, d in keys.items():
        found = oldest(d)
        if found is not None:
            cand = (quota - len(d), -visit.get(la, 0), found[1], found[0])
            if best is None or cand[:3] < best[:3]:
                best = cand
    return None if best is None else best[3]
