"""The device-resident expert cache: residency, policy and miss fills on the compute device.

Every MoE layer call resolves its routing to slots without the host: a `[layer, expert] ->
slot` map, each slot's key and last use, and the policy's victim choice are tensors on the
device, updated by a fixed sequence of tensor ops (no data-dependent shapes, no host sync), so
a decode step can be one CUDA graph at any budget. The misses are filled from the host tier,
which holds every routed expert (page-locked; on CUDA the fill kernel reads it in place,
kernels/slot_fill.py). The host learns after the step: hits, misses and bytes accumulate in
device counters that `drain` folds into OffloadStats once per step.

Policies (the call's own resident experts are never evicted; within a call the misses, in
ascending expert id, take the victims in the policy's order, ties by ascending slot id):
- `lru`: empty slots first, then by ascending last use (a per-call clock).
- `layer-lru`: each MoE layer may keep `slots // layers` experts; empty slots first, then the
  least recent slots of layers over their quota (only as many of each as it is over; the
  calling layer counts its misses as joining it), then everything else by last use. With one
  global LRU pool a step whose experts exceed the pool evicts exactly what the next layers
  need (hit rate 0 at batch 16); the quota keeps each layer's most recent experts.

Routing observers (the bench's trace recorder) get each call's ids after the step, not during
it: with the route log open (`open_route_log`), a call queues a copy of its ids into a row of
a fixed device buffer and notes (row, layer, pairs, K) on the host; `take_routes` reads every
call of the step in one device read after it. So an observed step keeps its CUDA graph and adds
no sync per layer (the graphs note the calls they replay: `mark` / `rewind` / `replayed`).

The fills run on the compute stream before the layer's expert kernel: their time is inside the
step's device time, and `exposed_fetch_s` (host-path copies waited for) stays 0 on this path;
the bench's TPOT against its bound says what they cost.

Requires that one layer's experts fit the pool (slots >= experts per layer), so any call,
decode or prefill, resolves in one wave; the engine uses it only then (offload/builder.py).
"""

from __future__ import annotations

import torch

from moetier.kernels.slot_fill import fill_slots
from moetier.offload.stats import OffloadStats

POLICIES = ("lru", "layer-lru")
_SPAN = 1 << 40  # above any last use: a score's priority band

# Legend: L MoE layers (by layer index, a table row each), E experts per layer, S slots,
# T tokens, K experts per token.


class DeviceCache:
    """Slot residency and LRU on the device for a pool of `S` slots over `host_rows`."""

    def __init__(
        self,
        pool: torch.Tensor,
        host_pool: torch.Tensor,
        host_row: torch.Tensor,
        num_experts: int,
        expert_bytes: int,
        policy: str = "lru",
    ) -> None:
        """pool [S, row] (the device slots), host_pool [R, row] (every expert's packed row),
        host_row [L, E] int64: each expert's host row (-1 where a layer has no experts)."""
        if policy not in POLICIES:
            raise ValueError(
                f"unknown device cache policy {policy!r}; choose from {', '.join(POLICIES)}"
            )
        num_slots = pool.shape[0]
        if num_slots < num_experts:
            raise ValueError(
                f"the device expert cache needs one layer's {num_experts} experts to fit the "
                f"pool ({num_slots} slots)"
            )
        dev = pool.device
        self.pool = pool
        self.host_pool = host_pool
        self.num_slots = num_slots
        self.num_experts = num_experts
        self.expert_bytes = expert_bytes
        layers = host_row.shape[0]
        self.policy = policy
        self.num_layers = layers
        moe_layers = int((host_row >= 0).any(dim=1).sum())
        self.quota = num_slots // max(moe_layers, 1)
        self.host_row = host_row.to(dev).reshape(-1)  # [L*E]
        self._keys = layers * num_experts  # flat key = layer * E + expert; one pad entry after
        self.slot_of = torch.full((self._keys + 1,), -1, dtype=torch.int64, device=dev)
        self.key_of = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.clock = torch.zeros((), dtype=torch.int64, device=dev)
        # hits, misses, evictions since the last drain
        self.counters = torch.zeros(3, dtype=torch.int64, device=dev)
        self._arange_e = torch.arange(num_experts, device=dev)
        self._protect = torch.iinfo(torch.int64).max
        self.route_log: torch.Tensor | None = None  # [calls, max pairs] a step's calls' ids
        self.logged: list[tuple[int, int, int, int]] = []  # (log row, layer, pairs, K) per call

    def open_route_log(self, max_pairs: int) -> None:
        """Let calls log their routing ids for observers (up to `max_pairs` per call; rows for
        two forwards of every layer: a capture's warm-up and the captured one)."""
        if self.route_log is None or self.route_log.shape[1] < max_pairs:
            dev = self.slot_of.device
            rows = 2 * self.num_layers
            self.route_log = torch.empty(rows, max_pairs, dtype=torch.int64, device=dev)

    def log_routes(self, layer: int, ids: torch.Tensor) -> bool:
        """Queue a copy of a call's ids [T, K] for `take_routes` (no sync); False when the log
        is closed or too small for the call (the caller then tells its observer at once)."""
        n, row = ids.numel(), len(self.logged)
        log = self.route_log
        if log is None or n > log.shape[1] or row >= log.shape[0]:
            return False
        log[row, :n].copy_(ids.reshape(-1))
        self.logged.append((row, layer, n, ids.shape[1]))
        return True

    def mark(self) -> int:
        return len(self.logged)

    def rewind(self, mark: int) -> list[tuple[int, int, int, int]]:
        """Drop the calls logged since `mark` (a capture's forwards); return them."""
        calls = self.logged[mark:]
        del self.logged[mark:]
        return calls

    def replayed(self, calls: list[tuple[int, int, int, int]]) -> None:
        """A graph replay made these calls (its capture's), writing their ids to their rows."""
        self.logged.extend(calls)

    def take_routes(self) -> list[tuple[int, list[int], int]]:
        """(layer, flat ids, K) of every call logged since the last take, in call order: one
        device read (after the step)."""
        log = self.route_log
        if not self.logged or log is None:
            self.logged.clear()
            return []
        flat = torch.cat([log[row, :n] for row, _, n, _ in self.logged]).tolist()
        out, at = [], 0
        for _, layer, n, k in self.logged:
            out.append((layer, flat[at : at + n], k))
            at += n
        self.logged.clear()
        return out

    def resolve(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] (this layer's routing, on the device) -> slots [T, K] int32 holding them,
        filling the misses first. Queued on the current stream; nothing waits for the device."""
        e, s = self.num_experts, self.num_slots
        # index_fill_ / fill_, never `t[i] = scalar`: on CUDA the scalar is staged on the host
        # and copied, which a CUDA graph capture refuses
        need = torch.zeros(e, dtype=torch.bool, device=ids.device)
        need.index_fill_(0, ids.reshape(-1), True)  # [E]
        keys = layer * e + self._arange_e  # [E]
        cur = self.slot_of[keys]  # [E]
        hit = need & (cur >= 0)
        miss = need & (cur < 0)
        score = self._score(layer, miss)
        score.scatter_(0, torch.where(hit, cur, s), self._protect)  # this call's hits stay
        order = torch.argsort(score[:s], stable=True)  # [S] first victims first
        rank = (torch.cumsum(miss, 0) - 1).clamp(min=0)  # [E] each miss's victim rank
        victim = torch.where(miss, order[rank], s)  # [E] slot, or the pad entry
        old = self.key_of[victim]  # [E] evicted key or -1
        evict = miss & (old >= 0)
        self.slot_of.scatter_(0, torch.where(evict, old, self._keys), -1)
        self.slot_of.scatter_(0, torch.where(miss, keys, self._keys), victim)
        self.slot_of[self._keys].fill_(-1)  # the pad took the non-misses' writes
        self.key_of.scatter_(0, victim, torch.where(miss, keys, -1))
        self.key_of[s].fill_(-1)
        now = self.slot_of[keys]  # [E]
        self.clock += 1
        self.last_use.scatter_(0, torch.where(need, now, s), self.clock.expand(e))
        src = torch.where(miss, self.host_row[keys], -1)
        fill_slots(self.host_pool, self.pool, src, torch.where(miss, victim, -1))
        self.counters += torch.stack([hit, miss, evict]).sum(dim=1)
        return now[ids].to(torch.int32)

    def _score(self, layer: int, miss: torch.Tensor) -> torch.Tensor:
        """[S + 1] eviction order key per slot, lowest first (the pad entry last)."""
        if self.policy == "lru":
            return self.last_use.clone()  # empty slots hold -1: first
        s, e, pad = self.num_slots, self.num_experts, self.num_layers
        key = self.key_of[:s]
        layer_of = torch.where(key >= 0, key // e, pad)  # [S], empty -> the pad layer
        # [L + 1]; not bincount, whose CUDA kernel reads the input's maximum on the host
        counts = torch.zeros(pad + 1, dtype=torch.int64, device=key.device)
        counts.scatter_add_(0, layer_of, torch.ones_like(layer_of))
        over = counts - self.quota
        over[layer] += miss.sum()  # the caller's misses join its layer
        over[pad].fill_(0)
        # each slot's rank among its layer's slots, least recent first
        by_layer = torch.argsort(layer_of * _SPAN + self.last_use[:s] + 1, stable=True)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(by_layer)
        rank[by_layer] = torch.arange(s, device=key.device) - start[layer_of[by_layer]]
        excess = rank < over[layer_of]
        prio = torch.where(key < 0, 0, torch.where(excess, 1, 2))  # [S]
        # within the band of layers at or under quota, the most recent use goes first: in a
        # step's layer order the layer just visited is the one needed last
        age = torch.where(prio == 2, _SPAN - 1 - self.last_use[:s], self.last_use[:s] + 1)
        score = torch.empty_like(self.last_use)
        score[:s] = prio * _SPAN + age
        score[s] = self._protect
        return score

    def drain(self, stats: OffloadStats) -> None:
        """Fold the counters since the last drain into `stats` (one device read: call it after
        the step, where the engine reads its sampled tokens anyway)."""
        hits, misses, evictions = self.counters.tolist()
        self.counters.zero_()
        stats.requests += hits + misses
        stats.device_hits += hits
        stats.host_hits += misses
        stats.evictions += evictions
        stats.bytes_host_to_device += misses * self.expert_bytes

    def resident(self) -> dict[int, int]:
        """{flat key: slot} of every resident expert (tests and integrity checks)."""
        keys = self.key_of[: self.num_slots].tolist()
        return {k: slot for slot, k in enumerate(keys) if k >= 0}

    def check_integrity(self) -> None:
        """slot_of and key_of are inverse maps; the pad entries are untouched."""
        slot_of = self.slot_of[: self._keys].tolist()
        held = {k: s for k, s in enumerate(slot_of) if s >= 0}
        assert held == self.resident(), "slot map and slot keys disagree"
        assert int(self.slot_of[self._keys]) == -1 and int(self.key_of[self.num_slots]) == -1
