"""Expert activation matrices (after MoE-Infinity): per request, layers x experts use counts,
matched against a bounded library of finished requests' matrices to estimate what a running
request will need.

Owns the matrices, the library and the estimate; it neither evicts nor prefetches (the
`activation` policy in `policy.py` and the `activation` predictor in `predict.py` use it).

Estimate for request r at MoE layer l, expert e (a per-token use frequency, summing to ~K
over e): need_r[l, e] = a * own_r[l, e] + (1 - a) * lib_r[l, e], where own_r is r's counts
divided by its tokens seen at l, lib_r the similarity-weighted mean of the `matches` library
matrices most similar to r's (cosine over the flattened counts), and a = t / (t + prior_tokens)
with t the tokens r has shown at l: the library speaks for a request that has shown little.

Requests are ids given per token. The tracker sees a step begin when a call's layer is not
after the previous call's layer; a request missing from a step's first call is retired (its
matrix goes to the library): every token of a step passes every MoE layer. `end_request`
retires one explicitly; once the caller says it reports every end (`retire_absent=False`, the
engine), a missing request is only waiting (preempted, or left out of a step) and keeps its
matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from moetier.offload.policy import _NO_KEY, Policy

ANONYMOUS = -1  # the request of tokens observed without request ids


class ActivationTracker:
    """Per-request activation matrices, the library of finished ones, and need estimates."""

    def __init__(
        self,
        capacity: int = 256,
        matches: int = 4,
        prior_tokens: float = 8.0,
        rematch_growth: float = 1.25,
        min_library_tokens: int = 4,
        half_life_tokens: float | None = None,
        retire_absent: bool = True,
    ) -> None:
        self.capacity = capacity
        # True: a request missing from a step is taken as ended (replayed traces say no more).
        self.retire_absent = retire_absent
        # None: own estimate from all of a request's tokens (MoE-Infinity's matrices); else
        # from counts decayed with this half-life in the request's tokens (recent ones weigh
        # more; the library still gets the plain counts).
        self._decay = None if half_life_tokens is None else 0.5 ** (1.0 / half_life_tokens)
        self.matches = matches
        self.prior_tokens = prior_tokens
        self.rematch_growth = rematch_growth
        self.min_library_tokens = min_library_tokens
        self._shape = (0, 0)  # (layer rows, expert columns); grows with the ids seen
        self._counts: dict[int, np.ndarray] = {}  # request -> [L, E] use counts
        self._tokens: dict[int, np.ndarray] = {}  # request -> [L] tokens seen per layer
        self._recent: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # r -> decayed counts, tokens
        self._seen: dict[int, int] = {}  # request -> step it was last seen in
        self._match: dict[int, tuple[float, np.ndarray | None]] = {}  # r -> (tokens, lib [L,E])
        self._lib_unit: list[np.ndarray] = []  # library: unit vectors of the flattened counts
        self._lib_freq: list[np.ndarray] = []  # library: [L, E] per-token frequencies
        self._lib_next = 0  # ring position once the library is full
        self._step = 0
        self._last_layer: int | None = None
        self.version = 0  # bumps whenever some request's estimate may have changed

    # observation
    def observe(
        self, layer: int, experts: Sequence[int], requests: Sequence[int] | None = None
    ) -> list[int]:
        """Count one MoE layer call; returns the call's distinct requests (first-seen order)."""
        if self._last_layer is not None and layer <= self._last_layer:
            self._new_step(None if requests is None else set(requests))
        self._last_layer = layer
        if requests is None:
            rows = [(ANONYMOUS, list(experts), 1)]
        else:
            k = len(experts) // max(len(requests), 1)
            assert k * len(requests) == len(experts), "experts must be [T*K] for [T] requests"
            per: dict[int, tuple[list[int], int]] = {}
            for t, r in enumerate(requests):
                ids, n = per.get(r, ([], 0))
                ids.extend(experts[t * k : (t + 1) * k])
                per[r] = (ids, n + 1)
            rows = [(r, ids, n) for r, (ids, n) in per.items()]
        top = max(experts, default=-1)
        self._grow(layer + 1, top + 1)
        for r, ids, n in rows:
            counts = self._counts.get(r)
            if counts is None:
                counts = self._counts[r] = np.zeros(self._shape, dtype=np.float32)
                self._tokens[r] = np.zeros(self._shape[0], dtype=np.float32)
            ids_a = np.asarray(ids, dtype=np.int64)
            np.add.at(counts[layer], ids_a, 1.0)
            self._tokens[r][layer] += n
            if self._decay is not None:
                rc, rt = self._recent.setdefault(
                    r, (np.zeros(self._shape, np.float32), np.zeros(self._shape[0], np.float32))
                )
                f = self._decay**n
                rc[layer] *= f
                rt[layer] = rt[layer] * f + n
                np.add.at(rc[layer], ids_a, 1.0)
            self._seen[r] = self._step
        self.version += 1
        return [r for r, _, _ in rows]

    def end_request(self, request: int) -> None:
        """Retire `request`: its matrix joins the library (if it showed enough tokens)."""
        counts = self._counts.pop(request, None)
        tokens = self._tokens.pop(request, None)
        self._seen.pop(request, None)
        self._match.pop(request, None)
        self._recent.pop(request, None)
        if counts is None or tokens is None or self.capacity <= 0:
            return
        if tokens.max() < self.min_library_tokens:
            return
        flat = counts.reshape(-1)
        norm = float(np.linalg.norm(flat))
        if norm == 0.0:
            return
        entry = (flat / norm, counts / np.maximum(tokens, 1.0)[:, None])
        if len(self._lib_unit) < self.capacity:
            self._lib_unit.append(entry[0])
            self._lib_freq.append(entry[1])
        else:  # full: replace the oldest
            self._lib_unit[self._lib_next], self._lib_freq[self._lib_next] = entry
            self._lib_next = (self._lib_next + 1) % self.capacity
        self.version += 1

    @property
    def active(self) -> list[int]:
        return list(self._counts)

    @property
    def library_size(self) -> int:
        return len(self._lib_unit)

    # estimates
    def need(self, layer: int, requests: Sequence[int]) -> np.ndarray:
        """[E] estimated per-token use frequency of each expert at `layer`, summed over
        `requests` (unknown requests and layers add nothing)."""
        out = np.zeros(self._shape[1], dtype=np.float32)
        if layer >= self._shape[0]:
            return out
        for r in requests:
            counts = self._counts.get(r)
            if counts is None:
                continue
            t = float(self._tokens[r][layer])
            a = t / (t + self.prior_tokens)
            if t > 0:
                recent = self._recent.get(r)
                if recent is None:
                    out += (a / t) * counts[layer]
                else:
                    out += (a / recent[1][layer]) * recent[0][layer]
            lib = self._library_estimate(r)
            if lib is not None:
                out += (1.0 - a) * lib[layer]
        return out

    def top_experts(self, layer: int, requests: Sequence[int], n: int) -> list[int]:
        """The `n` experts of `layer` with the highest need (positive only), best first; ties
        to the lower id."""
        need = self.need(layer, requests)
        order = np.argsort(-need, kind="stable")[:n]
        return [int(e) for e in order if need[e] > 0]

    # internals
    def _library_estimate(self, r: int) -> np.ndarray | None:
        if not self._lib_unit:
            return None
        total = float(self._tokens[r].sum())
        cached = self._match.get(r)
        if cached is not None and total < cached[0] * self.rematch_growth:
            return cached[1]
        est = self._matched(self._counts[r])
        self._match[r] = (max(total, 1.0), est)
        return est

    def _matched(self, counts: np.ndarray) -> np.ndarray | None:
        flat = counts.reshape(-1)
        norm = float(np.linalg.norm(flat))
        if norm == 0.0:
            return None
        lib = np.stack(self._lib_unit)  # [N, L*E]
        sims = lib @ (flat / norm)  # [N]
        top = np.argsort(-sims, kind="stable")[: self.matches]
        w = np.maximum(sims[top], 0.0)
        if float(w.sum()) <= 0.0:
            return None
        est = np.tensordot(w / w.sum(), np.stack([self._lib_freq[i] for i in top]), axes=1)
        return est.astype(np.float32)

    def _new_step(self, present: set[int] | None) -> None:
        """A step begins with a call whose requests are `present`: every token of a step goes
        through every MoE layer, so a request missing from it is not in this step; retire it.
        Without ids, retire the requests the previous step did not see."""
        self._step += 1
        if not self.retire_absent:
            return
        for r in list(self._seen):
            gone = r not in present if present is not None else self._seen[r] < self._step - 1
            if gone and r != ANONYMOUS:
                self.end_request(r)

    def _grow(self, layers: int, experts: int) -> None:
        rows, cols = self._shape
        if layers <= rows and experts <= cols:
            return
        shape = (max(rows, layers), max(cols, experts))
        pad = ((0, shape[0] - rows), (0, shape[1] - cols))
        self._counts = {r: np.pad(c, pad) for r, c in self._counts.items()}
        self._tokens = {r: np.pad(t, pad[0]) for r, t in self._tokens.items()}
        self._recent = {
            r: (np.pad(c, pad), np.pad(t, pad[0])) for r, (c, t) in self._recent.items()
        }
        self._lib_freq = [np.pad(f, pad) for f in self._lib_freq]
        self._lib_unit = [np.pad(u.reshape(rows, cols), pad).reshape(-1) for u in self._lib_unit]
        self._match = {}
        self._shape = shape


# The activation-aware eviction policy.
_AGE_EDGES = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128])  # steps since last use
_COUNT_EDGES = np.array([0.5, 1.2, 1.6, 2.0, 3.0, 4.0, 6.0, 9.0, 13.0, 18.0])  # decayed use count
_NEED_EDGES = np.array([1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8])  # tracker need
_NEVER = 1 << 40  # "last used" of a key never used: older than any age bucket


class ActivationPolicy(Policy):
    """Evicts the resident key with the lowest predicted need: the probability that its layer's
    next call uses it, per layer call until that call. Ties go to the least recently used.

    The probability is learned online, per feature cell, from the calls themselves: at each call
    of layer l, every expert of l counts one trial for the cell it sat in and a success if the
    call used it. A key's cell, fixed for its layer's next call when its layer is called:
    (steps since its last use, its use count decayed with a `half_life_steps` half-life, the
    activation need of the call's requests from `ActivationTracker`: the requests' own
    activation matrices blended with the library's most similar finished requests). Dividing
    by the MoE layers until its layer's next call weighs toward the layer just visited, like
    `least-stale` and `lfru`: with one global pool that layer's keys are needed last.

    A key inserted outside its layer's call (a prefetch) counts as certain until that call.
    Request ids come with `begin_call(..., requests=, routing=)` (the replay and the engine's
    cache pass them: `wants_routing`) and a request joins the library when `end_request` says
    it finished or when a step's first call goes without it; without ids every call counts as
    one anonymous request that never ends, so the need is the run's use frequency and the
    library stays empty.

    Cost: O(E) numpy work per call, O(L*E) per wave with an eviction (one partial sort; the
    victims of a wave come from it in order), where L layers, E experts.
    """

    wants_routing = True

    def __init__(self, half_life_steps: float = 16.0, **tracker_kw: Any) -> None:
        self.tracker = ActivationTracker(**tracker_kw)
        self._lam = math.log(2.0) / half_life_steps
        self._cells = (len(_AGE_EDGES) + 1) * (len(_COUNT_EDGES) + 1) * (len(_NEED_EDGES) + 1)
        # Successes and trials per cell, and per age bucket (all cells of that age): a cell's
        # estimate is smoothed toward its age bucket's with the weight of one trial, and an age
        # bucket's toward 0.1, so cells not seen yet start from what their age says.
        self._used = np.zeros(self._cells)
        self._trials = np.zeros(self._cells)
        self._age_used = np.full(len(_AGE_EDGES) + 1, 0.1)
        self._age_trials = np.ones(len(_AGE_EDGES) + 1)
        self._pos: dict[int, int] = {}  # MoE layer -> position in the step's layer order
        self._rows = 0
        self._cols = 0
        self._alloc(1, 1)
        self._keys: dict[tuple[int, int], Any] = {}  # (layer, expert) -> key as inserted
        self._live = 0
        self._dist: dict[int | None, np.ndarray] = {}  # current layer -> [L, 1] distances
        self._step = 0
        self._tick = 0
        self._layer: int | None = None  # layer of the current call
        self._cont = False  # the next begin_call without routing may continue this call
        self._order: list[tuple[int, int]] | None = None  # cached eviction order of the wave
        self._head = 0  # entries of _order before it are no longer resident

    # hooks
    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """`requests` / `routing`: the call's per-token request ids and top-k ids, given with
        its first wave only (later waves of the call pass None)."""
        self._order = None
        if routing is None and self._cont and layer == self._layer:
            return  # a later wave of the call already counted
        self._cont = routing is not None
        self._learn_layer(layer)
        if self._layer is not None and self._pos[layer] <= self._pos[self._layer]:
            self._step += 1
        self._layer = layer
        if routing is not None:
            flat = [e for row in routing for e in row]
            active = self.tracker.observe(layer, flat, requests)
        else:
            flat = list(experts)
            active = self.tracker.observe(layer, flat)
        used = np.array(sorted(set(flat)), dtype=np.int64)
        self._alloc(layer + 1, int(used[-1]) + 1 if len(used) else 1)
        self._call(layer, used, active)

    def end_request(self, request_id: int) -> None:
        """The request's activation matrix joins the library (`ActivationTracker.end_request`)."""
        self.tracker.end_request(request_id)

    def ends_reported(self) -> None:
        self.tracker.retire_absent = False

    def insert(self, key: Any) -> None:
        lk = (int(key[0]), int(key[1]))
        self._alloc(lk[0] + 1, lk[1] + 1)
        if lk not in self._keys:
            self._live += 1
        self._keys[lk] = key
        self._resident[lk] = True
        self._tick += 1
        self._last_tick[lk] = self._tick
        if lk[0] != self._layer:  # a prefetch: needed at its layer's next call
            self._p[lk] = 1.0
            self._order = None

    def touch(self, key: Any) -> None:
        self._tick += 1
        self._last_tick[int(key[0]), int(key[1])] = self._tick

    def remove(self, key: Any) -> None:
        lk = (int(key[0]), int(key[1]))
        del self._keys[lk]
        self._live -= 1
        self._resident[lk] = False

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        for full in (False, True):
            if self._order is None or full:
                self._order = self._ranked(None if full else 2 * len(exclude) + 8)
                self._head = 0
            order, keys = self._order, self._keys
            while self._head < len(order) and order[self._head] not in keys:
                self._head += 1  # evicted since the order was taken
            for i in range(self._head, len(order)):
                key = keys.get(order[i])
                if key is not None and key not in exclude:
                    return key
        raise RuntimeError(_NO_KEY)

    def order(self) -> list[Any]:
        return [self._keys[lk] for lk in self._ranked(None)]

    def probability(self, key: Any) -> float:
        """The key's learned probability of use at its layer's next call (1 for a prefetch)."""
        return float(self._p[int(key[0]), int(key[1])])

    # internals
    def _call(self, layer: int, used: np.ndarray, active: list[int]) -> None:
        """Learn from this call's use of layer's experts, then set each expert's cell and
        probability for the layer's next call (one step from now)."""
        cells = self._cell[layer]
        hit = np.zeros(self._cols, dtype=bool)
        hit[used] = True
        self._trials += np.bincount(cells, minlength=self._cells)
        self._used += np.bincount(cells[hit], minlength=self._cells)
        per_age = self._cells // len(self._age_used)
        self._age_trials += np.bincount(cells // per_age, minlength=len(self._age_used))
        self._age_used += np.bincount(cells[hit] // per_age, minlength=len(self._age_used))
        step = self._step
        count = self._count[layer] * np.exp(-self._lam * (step - self._count_step[layer]))
        count[used] += 1.0
        self._count[layer] = count
        self._count_step[layer] = step
        self._last_use[layer, used] = step
        age = step + 1 - self._last_use[layer]
        need = self.tracker.need(layer, active)[: self._cols]
        a = np.searchsorted(_AGE_EDGES, age)
        c = np.searchsorted(_COUNT_EDGES, count * math.exp(-self._lam))
        n = np.searchsorted(_NEED_EDGES, need)
        cells = (a * (len(_COUNT_EDGES) + 1) + c) * (len(_NEED_EDGES) + 1)
        cells[: len(n)] += n
        self._cell[layer] = cells
        prior = self._age_used[a] / self._age_trials[a]
        self._p[layer] = (self._used[cells] + prior) / (self._trials[cells] + 1.0)

    def _ranked(self, limit: int | None) -> list[tuple[int, int]]:
        """Resident keys, lowest predicted need per call first (ties: least recent); the first
        `limit` (and every key tied with the last of them) or all."""
        dist = self._dist.get(self._layer)
        if dist is None:  # MoE layers from each layer's position to the current one's next call
            n = len(self._pos) or 1
            cur = self._pos.get(self._layer, -1) if self._layer is not None else -1
            dist = np.full((self._rows, 1), float(n))
            for layer, pos in self._pos.items():
                dist[layer] = (pos - cur) % n or n
            self._dist[self._layer] = dist
        score = np.where(self._resident, self._p / dist, np.inf).ravel()
        if limit is not None and limit < self._live:
            idx = np.argpartition(score, limit)[: limit + 1]
            idx = np.flatnonzero(score <= score[idx].max())
        else:
            idx = np.flatnonzero(self._resident.ravel())
        ticks = self._last_tick.ravel()[idx]
        idx = idx[np.lexsort((ticks, score[idx]))]
        rows, cols = np.divmod(idx, self._cols)
        return list(zip(rows.tolist(), cols.tolist()))

    def _learn_layer(self, layer: int) -> None:
        if layer not in self._pos:
            self._pos = {la: i for i, la in enumerate(sorted({*self._pos, layer}))}
            self._dist = {}

    def _alloc(self, rows: int, cols: int) -> None:
        """Grow the per-key arrays to at least rows x cols."""
        if rows <= self._rows and cols <= self._cols and self._rows:
            return
        rows, cols = max(rows, self._rows), max(cols, self._cols)
        pad = ((0, rows - self._rows), (0, cols - self._cols))
        never = (len(_AGE_EDGES) * (len(_COUNT_EDGES) + 1)) * (len(_NEED_EDGES) + 1)
        if self._rows == 0:
            empty = np.zeros((0, 0))
            self._resident, self._p = empty.astype(bool), empty.copy()
            self._last_tick = empty.astype(np.int64)
            self._last_use, self._count_step = empty.astype(np.int64), empty.astype(np.int64)
            self._count, self._cell = empty.copy(), empty.astype(np.int64)
        self._resident = np.pad(self._resident, pad)
        self._p = np.pad(self._p, pad, constant_values=0.1)
        self._last_tick = np.pad(self._last_tick, pad)
        self._last_use = np.pad(self._last_use, pad, constant_values=-_NEVER)
        self._count_step = np.pad(self._count_step, pad)
        self._count = np.pad(self._count, pad)
        self._cell = np.pad(self._cell, pad, constant_values=never)
        self._rows, self._cols = rows, cols
        self._dist = {}
