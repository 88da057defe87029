"""Step-aware eviction for streamed steps: victims in the order of the step's next uses.

A policy of the registry in `offload/policy.py` (pure Python, no tensors): `StepAwarePolicy`
wraps another policy, and `StreamEviction` puts it around the configured policy for the layer
calls of streamed steps only (`stream_eviction`, on by default since the GPU ship gate; the
engine's cache and the replay both use it). `step-lru` in the registry is the wrapper always on,
around LRU.

Why: a streamed step (layer streaming, `layers/moe.py`: a long prefill or a big batch) touches
nearly every expert of every MoE layer, in increasing layer order, once. When the slot pool is
smaller than a step's working set, a key's next use is then known from its layer alone: a key
of a layer ahead of the current one is needed later in this step, farther ahead = later; a key
of a layer already finished is needed only in the next step, and the layer finished most
recently comes back last there. Belady's rule (evict the farthest next use) is therefore:

    (a) finished layers, the one finished most recently first (c-1, c-2, ..., first layer);
    (b) then layers ahead, the farthest first (last layer, ..., c+1);
    (c) the current layer c last (its keys of this call are pinned anyway);

LRU within a layer. That is one rule, "largest (layer - c) mod (layers), c itself last", so
no per-step bookkeeping is needed beyond the current layer. Plain LRU does the opposite: the
keys loaded longest ago are the layers ahead (loaded during the previous step), exactly the
ones needed soonest, so a streamed step reloads every expert (bench/results/
2026-12-06-step-aware-eviction.md, 2,048-token prompts on a 48 x 128 model at 25%: LRU loads
6,144 a step, this order 4,608-4,864, as does Belady's rule under the same streaming). It
reaches the one-step floor (4,608) for the first warm steps, then settles at 4,864: the
streamed prefetch holds two layers' slots, and the resident set drifts until it wraps; a fixed
per-layer reserve (`layer-lru`) settles at 4,808 but starts there, and overtakes it in
cumulative loads only after ~23 back-to-back prompts.

Decode steps (not streamed) touch few experts per layer, where the configured policy's
recency and frequency carry the information; `StreamEviction` leaves them to that policy
untouched (same victims, same order, no added cost per lookup).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from moetier.offload.policy import _NO_KEY, LRUPolicy, Policy


class StepAwarePolicy(Policy):
    """Victims in a streamed step's next-use order (module doc), forwarding every operation to
    `inner` so that it stays exact for the steps that follow.

    Active between `start()` and `stop()` (always, with `always=True`): `victim` and `order`
    follow the step order; inactive, they are `inner`'s. `start` groups the resident keys by
    layer in `inner`'s eviction order (O(n), once per run of streamed steps); while active,
    each insert, touch and remove is O(1) plus `inner`'s, a victim O(1) amortized in the
    layers holding keys (a layer list that changes only when a layer gains its first key or
    loses its last). Never returns a key in `exclude`.
    """

    def __init__(self, inner: Policy | None = None, always: bool = False) -> None:
        self.inner = inner if inner is not None else LRUPolicy()
        self.wants_routing = self.inner.wants_routing
        self.always = always
        self._layer: int | None = None  # the layer of the last `begin_call`
        self._keys: dict[int, OrderedDict[Any, None]] | None = None  # None: inactive
        self._layers: list[int] = []  # sorted: the layers holding at least one key
        if always:
            self.start()

    @property
    def active(self) -> bool:
        return self._keys is not None

    def start(self) -> None:
        """Take over victims (a streamed step begins); a no-op while active."""
        if self._keys is not None:
            return
        self._keys, self._layers = {}, []
        for key in self.inner.order():  # next victim first: LRU-first within each layer
            self._add(key)

    def stop(self) -> None:
        """Hand victims back to `inner` (unless `always`)."""
        if not self.always:
            self._keys, self._layers = None, []

    # hooks: forwarded
    def begin_call(
        self,
        layer: int,
        experts: Sequence[int],
        requests: Sequence[int] | None = None,
        routing: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._layer = layer
        self.inner.begin_call(layer, experts, requests, routing)

    def end_request(self, request_id: int) -> None:
        self.inner.end_request(request_id)

    def ends_reported(self) -> None:
        self.inner.ends_reported()

    def insert(self, key: Any) -> None:
        self.inner.insert(key)
        if self._keys is not None:
            self._add(key)

    def touch(self, key: Any) -> None:
        self.inner.touch(key)
        if self._keys is not None:
            self._keys[key[0]].move_to_end(key)

    def remove(self, key: Any) -> None:
        self.inner.remove(key)
        keys = self._keys
        if keys is not None:
            layer = keys[key[0]]
            del layer[key]
            if not layer:
                self._layers.remove(key[0])

    def victim(self, exclude: set | frozenset = frozenset()) -> Any:
        keys = self._keys
        if keys is None:
            return self.inner.victim(exclude)
        for layer in self._victim_layers():
            for key in keys[layer]:  # LRU first; skips only keys in use
                if key not in exclude:
                    return key
        raise RuntimeError(_NO_KEY)

    def order(self) -> list[Any]:
        keys = self._keys
        if keys is None:
            return self.inner.order()
        return [key for layer in self._victim_layers() for key in keys[layer]]

    # internals
    def _add(self, key: Any) -> None:
        assert self._keys is not None
        layer = self._keys.get(key[0])
        if layer is None:
            layer = self._keys[key[0]] = OrderedDict()
        if not layer:
            insort(self._layers, key[0])
        layer[key] = None

    def _victim_layers(self) -> Iterator[int]:
        """Layers holding keys, farthest next use first: below the current layer descending
        (finished this step, the latest first), then above it descending (ahead, the farthest
        first), then the current layer. Before any call: all descending."""
        layers = self._layers
        cut = len(layers) if self._layer is None else bisect_left(layers, self._layer)
        for j in range(cut - 1, -1, -1):
            yield layers[j]
        for j in range(len(layers) - 1, cut - 1, -1):
            yield layers[j]


class StreamEviction:
    """`base` as is, with a `StepAwarePolicy` around it for the layer calls of streamed steps.

    The MoE block calls `streaming(layer)` before fetching a call that streams (or would, but
    for being the last MoE layer); the cache calls `call(layer)` at the start of every fetch,
    before the policy's `begin_call`, and uses the policy it returns for that fetch and what
    follows it until the next (the streamed prefetch of the next layer included). A call not
    announced hands victims back to `base`, so steps that do not stream see `base` alone.
    Calls that stream are single-wave (the block streams only when a call's experts fit the
    pool at once).
    """

    def __init__(self, base: Policy) -> None:
        self.base = base
        self.step_aware = StepAwarePolicy(base)
        self.policy: Policy = base
        self.armed: int | None = None  # the layer whose next call streams

    def streaming(self, layer: int) -> None:
        self.armed = layer

    def call(self, layer: int) -> Policy:
        """A fetch of `layer` begins: the policy for it."""
        stream = self.armed == layer
        self.armed = None
        if stream and self.policy is self.base:
            self.step_aware.start()
            self.policy = self.step_aware
        elif not stream and self.policy is not self.base:
            self.step_aware.stop()
            self.policy = self.base
        return self.policy
