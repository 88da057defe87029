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

Requests are ids given per token. A request is retired (its matrix goes to the library) when a
step passes without it: the tracker sees a step begin when a call's layer is not after the
previous call's layer. `end_request` retires one explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
    ) -> None:
        self.capacity = capacity
        self.matches = matches
        self.prior_tokens = prior_tokens
        self.rematch_growth = rematch_growth
        self.min_library_tokens = min_library_tokens
        self._shape = (0, 0)  # (layer rows, expert columns); grows with the ids seen
        self._counts: dict[int, np.ndarray] = {}  # request -> [L, E] use counts
        self._tokens: dict[int, np.ndarray] = {}  # request -> [L] tokens seen per layer
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
            self._new_step()
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
            np.add.at(counts[layer], np.asarray(ids, dtype=np.int64), 1.0)
            self._tokens[r][layer] += n
            self._seen[r] = self._step
        self.version += 1
        return [r for r, _, _ in rows]

    def end_request(self, request: int) -> None:
        """Retire `request`: its matrix joins the library (if it showed enough tokens)."""
        counts = self._counts.pop(request, None)
        tokens = self._tokens.pop(request, None)
        self._seen.pop(request, None)
        self._match.pop(request, None)
        if counts is None or tokens is None or tokens.max() < self.min_library_tokens:
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
                out += (a / t) * counts[layer]
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

    def _new_step(self) -> None:
        """A step ended: retire the requests it did not see."""
        for r in [r for r, s in self._seen.items() if s < self._step and r != ANONYMOUS]:
            self.end_request(r)
        self._step += 1

    def _grow(self, layers: int, experts: int) -> None:
        rows, cols = self._shape
        if layers <= rows and experts <= cols:
            return
        shape = (max(rows, layers), max(cols, experts))
        pad = ((0, shape[0] - rows), (0, shape[1] - cols))
        self._counts = {r: np.pad(c, pad) for r, c in self._counts.items()}
        self._tokens = {r: np.pad(t, pad[0]) for r, t in self._tokens.items()}
        self._lib_freq = [np.pad(f, pad) for f in self._lib_freq]
        self._lib_unit = [np.pad(u.reshape(rows, cols), pad).reshape(-1) for u in self._lib_unit]
        self._match = {}
        self._shape = shape
