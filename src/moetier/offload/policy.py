"""Replacement policies for expert slots: small pure-Python classes behind a registry.

A policy only orders keys; it never touches tensors, and it never returns a key in `exclude`
(the wave being loaded). Testable on recorded traces (`moetier replay`).

The cache calls `begin_call(layer, experts)` at the start of every fetch (one wave of one MoE
layer call), then `touch` per hit, `victim(exclude=wave)` + `remove` per eviction and `insert`
per load; a policy whose `wants_routing` is True also gets each token's request id and top-k
ids with a call's first wave. `end_request(id)` says the engine is done with a request. Keys
are `(layer, expert)` pairs (`ExpertKey` in the engine, tuples in the replay). Every operation
is O(1) or O(log n) amortized (lazy heaps; stale entries are skipped when they surface and the
heaps are rebuilt when they grow past a few times the live entries).

Why layer-aware policies: the engine visits the MoE layers in order every step and all layers
share one slot pool. A key of layer l used in this step cannot be needed again before the next
step reaches l, so the layer just visited holds the stalest keys. Plain LRU evicts the oldest
key, which is exactly the one the next layer needs when the pool is smaller than a step's
working set, and its hit rate falls to 0 there.

`layer-lru` (per-layer slot quotas) lives in `offload/layer_lru.py`; `activation` (learned use
probabilities from recency, frequency and per-request activation matrices) lives in
`offload/activation.py` with the matrices it shares with the `activation` predictor; `step-lru`
(victims in a streamed step's next-use order, always on) lives in `offload/step_aware.py`, with
the wrapper that `stream_eviction` puts around the configured policy for streamed steps only;
`hazard` (a reuse-probability table learned online over recency, decayed frequency and the
request's share, no numpy) lives in `offload/hazard.py`.
All build on `Policy`, so the registry imports them when asked for.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from moetier.errors import ConfigError

_NO_KEY = "no evictable key: every resident key is in use"


class Policy:
    """Tracks resident keys and picks an eviction victim among them."""

    # True: the engine's cache builds each call's per-token request ids and routing for
    # `begin_call` (host lists per MoE layer call; policies that ignore them skip that cost).
    wants_routing = False

    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """A wave of `experts` of MoE layer `layer` is about to be fetched (optional hook).

        `requests` and `routing` (optional, with a call's first wave only): each token's
        request id and its top-k expert ids, as a trace record has them. The replay passes
        them; the engine's cache passes them only when `wants_routing` is True (and `requests`
        may still be None when the step's request ids are unknown), so a policy must work
        without them.
        """

    def end_request(self, request_id: int) -> None:
        """The engine finished (or aborted, or failed) request `request_id` (optional hook)."""

    def ends_reported(self) -> None:
        """The caller reports every request's end through `end_request`: a request missing
        from a step is waiting (preempted, or left out of the step), not finished (hook)."""

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
        for key in self._order:  # at most len(exclude) keys skipped
            if key not in exclude:
                return key
        raise RuntimeError(_NO_KEY)

    def order(self) -> list[Any]:
        """Keys from next victim to most recently used."""
        return list(self._order)


def _pop_best(
    heap: list[tuple[Any, ...]], live: Callable[[tuple[Any, ...]], bool], exclude: Any
) -> tuple[Any, ...] | None:
    """Smallest live entry of a lazy heap whose last field is not in `exclude`; stale entries
    are dropped, excluded ones pushed back."""
    held = []
    found = None
    while heap:
        entry = heap[0]
        if not live(entry):
            heapq.heappop(heap)
        elif entry[-1] in exclude:
            held.append(heapq.heappop(heap))
        else:
            found = entry
            break
    for entry in held:
        heapq.heappush(heap, entry)
    return found


class LFUPolicy(Policy):
    """Evicts the key used least often since it was inserted; ties go to the least recent.

    A lazy min-heap of (count, tick of last use, key): O(log n) per operation.
    """

    def __init__(self) -> None:
        self._state: dict[Any, tuple[int, int]] = {}  # key -> (count, tick of last use)
        self._heap: list[tuple[int, int, Any]] = []
        self._tick = 0

    def _push(self, key: Any, count: int) -> None:
        self._tick += 1
        self._state[key] = (count, self._tick)
        heapq.heappush(self._heap, (count, self._tick, key))
        if len(self._heap) > 4 * len(self._state) + 64:
            self._heap = [(c, t, k) for k, (c, t) in self._state.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Any) -> None:
        self._push(key, 1)

    def touch(self, key: Any) -> None:
        self._push(key, self._state[key][0] + 1)

    def remove(self, key: Any) -> None:
        del self._state[key]

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        found = _pop_best(self._heap, lambda e: self._state.get(e[2]) == e[:2], exclude)
        if found is None:
            raise RuntimeError(_NO_KEY)
        return found[2]

    def order(self) -> list[Any]:
        return sorted(self._state, key=lambda k: self._state[k])


class LayeredPolicy(Policy):
    """Evicts the resident key with the smallest (rank(key) - stale_weight * visit[layer], tick).

    `rank` is fixed between two uses of a key (subclasses define it); `visit[layer]` is the
    clock of the layer's last call (the clock advances once per `begin_call`), so keys of the
    layers visited most recently -- whose next use is furthest in the step's layer order --
    go first. One lazy min-heap of keys per layer, one lazy min-heap of layers keyed by their
    best key's score: O(log n) per operation.
    """

    def __init__(self) -> None:
        self._clock = 0
        self._tick = 0  # ties: the key used earlier goes first
        self._visit: dict[int, int] = {}
        self._rank: dict[Any, tuple[float, int]] = {}  # resident key -> (rank, tick)
        self._keys: dict[int, list[tuple[float, int, Any]]] = {}  # layer -> lazy heap
        self._live: dict[int, int] = {}  # layer -> resident keys
        self._layers: list[tuple[float, int, int, int]] = []  # (score, tick, version, layer)
        self._version: dict[int, int] = {}
        self._score: dict[int, tuple[float, int]] = {}  # layer -> its published best score

    # subclasses
    def _use(self, key: Any, new: bool) -> float:
        """Record a use of `key` now; return its rank (smaller is evicted first). A key's rank
        must never fall when it is used again (`_set` relies on it)."""
        raise NotImplementedError

    def _stale_weight(self) -> float:
        raise NotImplementedError

    # hooks
    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._clock += 1
        known = layer in self._visit
        self._visit[layer] = self._clock
        for each in [layer] if known else list(self._visit):  # a new layer may change weights
            self._publish(each)

    def insert(self, key: Any) -> None:
        self._live[key[0]] = self._live.get(key[0], 0) + 1
        self._set(key, self._use(key, new=True))

    def touch(self, key: Any) -> None:
        self._set(key, self._use(key, new=False))

    def remove(self, key: Any) -> None:
        _, tick = self._rank.pop(key)
        self._live[key[0]] -= 1
        if self._score.get(key[0], (0.0, -1))[1] == tick:  # it was its layer's best
            self._publish(key[0])

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        best: tuple[float, int, Any] | None = None
        held = []
        while self._layers:  # layers in order of their best key's score, a lower bound
            score, tick, version, layer = self._layers[0]
            if self._version.get(layer) != version:
                heapq.heappop(self._layers)
                continue
            if best is not None and (score, tick) >= best[:2]:
                break
            held.append(heapq.heappop(self._layers))
            found = self._best_key(layer, exclude)
            if found is not None:
                cand = (found[0] - self._weight(layer), found[1], found[2])
                if best is None or cand[:2] < best[:2]:
                    best = cand
        for entry in held:
            heapq.heappush(self._layers, entry)
        if best is None:
            raise RuntimeError(_NO_KEY)
        return best[2]

    def order(self) -> list[Any]:
        def score(k: Any) -> tuple[float, int]:
            rank, tick = self._rank[k]
            return rank - self._weight(k[0]), tick

        return sorted(self._rank, key=score)

    # internals
    def _weight(self, layer: int) -> float:
        return self._stale_weight() * self._visit.get(layer, 0)

    def _set(self, key: Any, rank: float) -> None:
        layer = key[0]
        old = self._rank.get(key)
        self._tick += 1
        self._rank[key] = (rank, self._tick)
        heap = self._keys.setdefault(layer, [])
        heapq.heappush(heap, (rank, self._tick, key))
        if len(heap) > 4 * self._live[layer] + 64:
            live = [(r, t, k) for k, (r, t) in self._rank.items() if k[0] == layer]
            heapq.heapify(live)
            self._keys[layer] = live
        # Ranks only grow with use, so the layer's best changes only if this key was it or
        # now beats it; otherwise the published score stands (saves a heap walk per hit).
        best = self._score.get(layer)
        score = (rank - self._weight(layer), self._tick)
        if best is None or (old is not None and old[1] == best[1]):
            self._publish(layer)
        elif score < best:
            self._push_layer(layer, score)

    def _best_key(self, layer: int, exclude: Any) -> tuple[float, int, Any] | None:
        heap = self._keys.get(layer)
        if not heap:
            return None
        rank = self._rank
        while heap:  # common case: drop stale tops, return a live one not excluded
            r, t, k = heap[0]
            live = rank.get(k)
            if live is None or live[1] != t:
                heapq.heappop(heap)
            elif k in exclude:
                return _pop_best(heap, lambda e: rank.get(e[2]) == e[:2], exclude)  # type: ignore[return-value]
            else:
                return heap[0]
        return None

    def _publish(self, layer: int) -> None:
        """Put the layer's current best score on the layer heap (if it changed)."""
        found = self._best_key(layer, ())
        score = None if found is None else (found[0] - self._weight(layer), found[1])
        if score == self._score.get(layer):
            return
        if score is None:
            self._version[layer] = self._version.get(layer, 0) + 1
            self._score.pop(layer, None)
            return
        self._push_layer(layer, score)

    def _push_layer(self, layer: int, score: tuple[float, int]) -> None:
        version = self._version.get(layer, 0) + 1
        self._version[layer] = version
        self._score[layer] = score
        heapq.heappush(self._layers, (score[0], score[1], version, layer))
        if len(self._layers) > 4 * len(self._score) + 64:
            self._layers = [(s, t, self._version[la], la) for la, (s, t) in self._score.items()]
            heapq.heapify(self._layers)


class LeastStalePolicy(LayeredPolicy):
    """Evicts the key whose layer has been visited most often since its last use (LRU counted
    in steps); among those, the key of the layer visited most recently (its next use is the
    furthest in the step's layer order), then the least recent.

    Score = last use - 2 * last visit of the layer = -(visit + age at that visit): every key's
    age at its layer's visit is a whole number of steps, so steps unused dominate and the
    layer order breaks ties.
    """

    def _use(self, key: Any, new: bool) -> float:
        return float(self._clock)

    def _stale_weight(self) -> float:
        return 2.0


class LFRUPolicy(LayeredPolicy):
    """Frequency and recency: evicts the key with the smallest use count decayed with a
    half-life of `half_life_steps` steps, counted over the key's whole history (kept after
    eviction, at most one entry per expert), compared as of its layer's last visit and
    weighted toward the layers visited most recently (least-stale).

    rank = log(count at last use) + lam * last use; log of the count decayed to time T is
    rank - lam * T, so ranks compare without rescoring. lam is per call: ln 2 over
    (half-life x MoE layers seen), fixed once one step has visited every layer.
    """

    def __init__(self, half_life_steps: float = 4.0, stale: float = 2.0) -> None:
        super().__init__()
        self.half_life_steps = half_life_steps
        self.stale = stale
        self._history: dict[Any, tuple[float, int]] = {}  # key -> (count at t, t)
        self._lam = math.log(2.0) / half_life_steps  # per call; set per MoE layers seen

    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if layer not in self._visit:
            self._lam = math.log(2.0) / (self.half_life_steps * (len(self._visit) + 1))
        super().begin_call(layer, experts)

    def _use(self, key: Any, new: bool) -> float:
        lam = self._lam
        count, t = self._history.get(key, (0.0, self._clock))
        count = count * math.exp(-lam * (self._clock - t)) + 1.0
        self._history[key] = (count, self._clock)
        return math.log(count) + lam * self._clock

    def _stale_weight(self) -> float:
        return self.stale * self._lam


def _layer_lru() -> Policy:
    from moetier.offload.layer_lru import LayerLRUPolicy  # builds on Policy, like activation

    return LayerLRUPolicy()


def _step_lru() -> Policy:
    # offload/step_aware.py builds on this module (Policy, LRUPolicy), as layer_lru does.
    from moetier.offload.step_aware import StepAwarePolicy

    return StepAwarePolicy(LRUPolicy(), always=True)


def _hazard() -> Policy:
    # offload/hazard.py builds on this module (Policy), as layer_lru does.
    from moetier.offload.hazard import HazardPolicy

    return HazardPolicy()


def _activation() -> Policy:
    # offload/activation.py builds on this module (Policy), so it is imported when asked for.
    from moetier.offload.activation import ActivationPolicy

    return ActivationPolicy()


POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": LRUPolicy,
    "layer-lru": _layer_lru,
    "lfu": LFUPolicy,
    "lfru": LFRUPolicy,
    "least-stale": LeastStalePolicy,
    "activation": _activation,
    "step-lru": _step_lru,
    "hazard": _hazard,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown expert-cache policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
