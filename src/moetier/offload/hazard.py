"""The `hazard` expert-slot policy: evict the key least likely to be used again soon, from a
reuse-probability table learned online from the calls themselves.

A policy of the registry in `offload/policy.py` (pure Python, no tensors, no numpy); the
registry imports it when asked for, as it does `activation`.

Why: on the recorded routing traces (`bench/traces/`) the chance that a key of layer l is used
at l's next call falls steeply with the steps since its last use and rises with how often it
was used lately and how often the current request used it; a key last used by an earlier
request is rarely used again (`bench/results/2026-12-07-policy-replay.md`, the reuse study).
LRU sees only the first of these, and in one global pool it also ignores that the layer just
visited is needed last. This policy estimates each key's probability of use directly:

* A key's cell, fixed when its layer is called: (steps since its last use, bucketed; its use
  count decayed with a `half_life` in steps, bucketed; whether its last use was by a request
  not in this call; whether its last use was a many-token call, a prefill) and, in a finer
  table, the share of the current request's tokens at this layer that used it.
* At every call of layer l each resident key of l is one trial of its cell and a success if
  the call uses it; a cell's estimate is (successes + prior) / (trials + weight), the fine
  table smoothed toward the coarse one. Only resident keys are counted, so per call the work is
  the layer's resident keys plus the call's experts.
* Score = probability / (MoE layer calls until the key's layer is called again + `gap` x MoE
  layers): with one global pool the layer just visited is needed last, as in `least-stale`
  and `activation`, but only mildly (`gap`), since the step's layer order is a small part of a
  key's next-use distance once it misses one call.

The victim is the resident key outside `exclude` with the lowest score; ties go to the lower
(probability, last use, expert) within a layer and the lower layer across layers. Each layer
keeps its keys sorted by probability from its last call (scores change only then, and the
distance term is the same for all keys of a layer); a heap of layers keyed by their first
resident key's score, rebuilt at a call's first eviction, finds the victim in O(log layers)
amortized.

A key inserted outside its layer's call (a prefetch) counts as certain until that call.
Request ids come with `begin_call(..., requests=, routing=)` (`wants_routing`); without them
every call is one request and the request features are constant.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from moetier.offload.policy import _NO_KEY, Policy

AGE_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # steps since last use: <= edge -> bucket
COUNT_EDGES = (1.05, 1.3, 1.6, 2.0, 2.5, 3.2, 4.0, 5.5, 8.0, 12.0)  # decayed use count
SHARE_EDGES = (0.0, 0.03, 0.07, 0.12, 0.2, 0.35)  # uses / tokens of the current request
_NEVER = -(1 << 30)  # last use of a key never used
_OTHER, _MANY = 1, 2  # flag bits: last use by another request; last use in a many-token call


class _Layer:
    """Per-expert state of one MoE layer (lists indexed by expert id) and its eviction order."""

    __slots__ = (
        "last",
        "count",
        "req",
        "many",
        "req_uses",
        "cell",
        "p",
        "res",
        "keys",
        "order",
        "head",
        "pending",
    )

    def __init__(self) -> None:
        self.last: list[int] = []  # step of last use
        self.count: list[float] = []  # decayed use count as of the last use
        self.req: list[Any] = []  # request of the last use
        self.many: list[bool] = []  # last use in a call of more than one token
        self.req_uses: list[int] = []  # uses by the request of the last use
        self.cell: list[int] = []  # fine cell for this layer's next call (-1: none)
        self.p: list[float] = []  # probability of use at this layer's next call
        self.res: set[int] = set()  # resident experts
        self.keys: dict[int, Any] = {}  # resident expert -> key as inserted
        self.order: list[int] = []  # experts by (p, last use, id) as of the layer's last call
        self.head = 0  # order[:head] are no longer resident
        self.pending: set[int] = set()  # the current call's experts not yet inserted

    def grow(self, n: int) -> None:
        m = n - len(self.last)
        if m > 0:
            self.last += [_NEVER] * m
            self.count += [0.0] * m
            self.req += [None] * m
            self.many += [False] * m
            self.req_uses += [0] * m
            self.cell += [-1] * m
            self.p += [0.0] * m

    def first(self) -> int | None:
        """The first resident (or pending) expert of `order`, advancing `head` past the rest."""
        order, res, pending, h = self.order, self.res, self.pending, self.head
        while h < len(order) and order[h] not in res and order[h] not in pending:
            h += 1
        self.head = h
        return order[h] if h < len(order) else None


class HazardPolicy(Policy):
    """Evicts the resident key with the lowest learned probability of use at its layer's next
    call over the calls until then (see the module docstring)."""

    wants_routing = True

    def __init__(
        self, half_life: float = 8.0, gap: float = 0.3, prior: float = 0.1, weight: float = 4.0
    ) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.gap = gap
        self.prior = prior
        self.weight = weight
        self._ages = len(AGE_EDGES) + 1
        self._counts = len(COUNT_EDGES) + 1
        self._coarse = 4 * self._ages * self._counts  # x 4 flag combinations
        fine = self._coarse * (len(SHARE_EDGES) + 1)
        self._cu = [0.0] * self._coarse  # successes and trials per coarse cell
        self._ct = [0.0] * self._coarse
        self._fu = [0.0] * fine  # ... per fine cell (coarse cell x request share)
        self._ft = [0.0] * fine
        self._age_bucket = [bisect_left(AGE_EDGES, a) for a in range(AGE_EDGES[-1] + 2)]
        self._step = 0
        self._layer: int | None = None
        self._cont = False  # the next begin_call without routing may continue this call
        self._pos: dict[int, int] = {}  # MoE layer -> position in the step's layer order
        self._layers: dict[int, _Layer] = {}
        self._div: dict[int, float] = {}  # layer -> calls until its next call + gap x layers
        self._heap: list[tuple[float, int]] = []  # (lower bound of a layer's best score, layer)
        self._stale = False  # _div and _heap predate the current call
        self._tokens: dict[int, dict[Any, int]] = {}  # layer -> request -> tokens seen

    # hooks
    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Learn from this call, then score the layer's resident keys and the call's experts
        for the layer's next call. A later wave of a call (no routing) changes nothing."""
        if routing is None and self._cont and layer == self._layer:
            return
        self._cont = routing is not None
        if layer not in self._pos:
            self._pos = {la: i for i, la in enumerate(sorted({*self._pos, layer}))}
        if self._layer is not None and self._pos[layer] <= self._pos[self._layer]:
            self._step += 1
        if self._layer is not None and self._layer in self._layers:
            self._layers[self._layer].pending = set()  # the previous call is over
        self._layer = layer
        uses: dict[int, int] = {}
        if routing is not None:
            for row in routing:
                for e in row:
                    uses[e] = uses.get(e, 0) + 1
            ntok = len(routing)
            req = requests[0] if requests else None
        else:
            uses = dict.fromkeys(experts, 1)
            ntok, req = 1, None
        lay = self._layers.get(layer)
        if lay is None:
            lay = self._layers[layer] = _Layer()
        if uses:
            lay.grow(max(uses) + 1)
        self._learn(lay, uses)
        tokens = self._tokens.setdefault(layer, {})
        seen = tokens[req] = tokens.get(req, 0) + ntok
        self._record(lay, uses, req, ntok > 1)
        self._score(lay, uses, req, seen)
        self._stale = True  # distances and the layer heap: rebuilt when first needed

    def insert(self, key: Any) -> None:
        layer, e = key[0], key[1]
        lay = self._layers.get(layer)
        if lay is None:
            lay = self._layers[layer] = _Layer()
        lay.grow(e + 1)
        lay.keys[e] = key
        if e in lay.res:
            return
        lay.res.add(e)
        if e in lay.pending:
            lay.pending.discard(e)
            return
        # a prefetch (or a key loaded outside its call): certain until its layer's call
        lay.cell[e] = -1
        lay.p[e] = 1.0
        lay.order.append(e)
        if not self._stale:
            heapq.heappush(self._heap, (-1.0, layer))  # a stale bound, revalidated in victim

    def touch(self, key: Any) -> None:
        """Uses are counted from the call's routing in `begin_call`."""

    def remove(self, key: Any) -> None:
        lay = self._layers[key[0]]
        lay.res.discard(key[1])
        del lay.keys[key[1]]

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        if self._stale:
            self._rebuild_heap()
        heap = self._heap
        best: tuple[float, int, Any] | None = None
        held: list[tuple[float, int]] = []
        while heap:
            bound, la = heap[0]
            lay = self._layers[la]
            e = lay.first()
            if e is None:
                heapq.heappop(heap)
                continue
            score = lay.p[e] / self._div.get(la, 1.0)
            if score != bound:  # the layer's first key changed since the entry was pushed
                heapq.heapreplace(heap, (score, la))
                continue
            if best is not None and (bound, la) >= best[:2]:
                break
            held.append(heapq.heappop(heap))
            found = self._first_allowed(lay, exclude)
            if found is not None:
                cand = (lay.p[found] / self._div.get(la, 1.0), la, lay.keys[found])
                if best is None or cand[:2] < best[:2]:
                    best = cand
        for entry in held:
            heapq.heappush(heap, entry)
        if best is None:
            raise RuntimeError(_NO_KEY)
        return best[2]

    def order(self) -> list[Any]:
        """Resident keys in eviction order as of now (next victim first)."""
        if self._stale:
            self._rebuild_heap()
        ranked = []
        for la, lay in self._layers.items():
            div = self._div.get(la, 1.0)
            for i, e in enumerate(lay.order):
                if e in lay.res:
                    ranked.append((lay.p[e] / div, la, i, lay.keys[e]))
        ranked.sort(key=lambda r: r[:3])
        return [r[3] for r in ranked]

    def probability(self, key: Any) -> float:
        """The key's learned probability of use at its layer's next call (1 for a prefetch)."""
        return self._layers[key[0]].p[key[1]]

    # internals
    def _learn(self, lay: _Layer, uses: dict[int, int]) -> None:
        """Each resident key of the layer is a trial of the cell it was given at the layer's
        last call; a success if this call uses it."""
        cu, ct, fu, ft, coarse = self._cu, self._ct, self._fu, self._ft, self._coarse
        cell = lay.cell
        for e in lay.res:
            c = cell[e]
            if c >= 0:
                ft[c] += 1.0
                ct[c % coarse] += 1.0
                if e in uses:
                    fu[c] += 1.0
                    cu[c % coarse] += 1.0

    def _record(self, lay: _Layer, uses: dict[int, int], req: Any, many: bool) -> None:
        step, decay = self._step, self.decay
        last, count, reqs, flag, req_uses = lay.last, lay.count, lay.req, lay.many, lay.req_uses
        for e, b in uses.items():
            age = step - last[e]
            count[e] = (count[e] * decay**age if age < 1000 else 0.0) + b
            last[e] = step
            if reqs[e] != req:
                req_uses[e] = 0
                reqs[e] = req
            req_uses[e] += b
            flag[e] = many

    def _score(self, lay: _Layer, uses: dict[int, int], req: Any, seen: int) -> None:
        """Cell and probability for the layer's next call (one step on) of every resident key
        and every expert of this call; the layer's order sorted by them."""
        cu, ct, fu, ft = self._cu, self._ct, self._fu, self._ft
        ages, counts, coarse = self._ages, self._counts, self._coarse
        age_bucket, top = self._age_bucket, len(self._age_bucket) - 1
        prior, weight = self.prior, self.weight
        step = self._step + 1
        last, count, reqs, many, req_uses = lay.last, lay.count, lay.req, lay.many, lay.req_uses
        cell, p = lay.cell, lay.p
        keys = lay.res.union(uses)
        for e in keys:
            own = reqs[e] == req
            f = (0 if own or req is None else _OTHER) | (_MANY if many[e] else 0)
            age = step - last[e]
            c = (f * ages + age_bucket[age if age < top else top]) * counts
            c += bisect_left(COUNT_EDGES, count[e])
            pc = (cu[c] + prior * 0.5) / (ct[c] + 0.5)
            share = bisect_left(SHARE_EDGES, req_uses[e] / seen) if own else 0
            c += coarse * share
            cell[e] = c
            p[e] = (fu[c] + weight * pc) / (ft[c] + weight)
        lay.order = sorted(keys, key=lambda e: (p[e], last[e], e))
        lay.head = 0
        lay.pending = keys - lay.res

    def _rebuild_heap(self) -> None:
        """The distances as of the current call, and one heap entry per layer with keys: its
        first key's score (a lower bound for any exclude). Once per call, at its first victim
        (a call with no miss skips it)."""
        n = len(self._pos)
        cur = self._pos[self._layer] if self._layer is not None else 0
        g = self.gap * n
        self._div = {la: ((p - cur) % n or n) + g for la, p in self._pos.items()}
        self._stale = False
        heap = []
        for la, lay in self._layers.items():
            e = lay.first()
            if e is not None:
                heap.append((lay.p[e] / self._div.get(la, 1.0), la))
        heapq.heapify(heap)
        self._heap = heap

    def _first_allowed(self, lay: _Layer, exclude: Any) -> int | None:
        order, res, keys = lay.order, lay.res, lay.keys
        for i in range(lay.head, len(order)):
            e = order[i]
            if e in res and keys[e] not in exclude:
                return e
        return None
