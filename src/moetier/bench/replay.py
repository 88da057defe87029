"""Replaying a routing trace through expert-slot policies and Belady's optimum: hit rates only.

Owns the offline policy simulation (no tensors, no timing). Semantics are the engine's device
tier (`offload/expert_cache.py`): one global pool of S slots over all MoE layers, S = the expert
budget's share of all routed experts (as `offload/builder.py` computes it, at least top-k);
each layer call needs its distinct experts, ascending, resident at once, in waves of at most S;
a miss takes a free slot, else evicts the policy's victim among keys outside the wave; a hit
touches the key. When every expert fits, the engine preloads them all and so does the replay.
The hit rate is hits over distinct-expert lookups, as `offload_stats()` counts them; Belady's
is `bench/belady.py`'s on the same waves.

Policies come from `offload/policy.py`'s registry (`make_policy`), the very classes the engine
runs; each is O(log n) per operation, so a 100k-line trace replays in seconds.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moetier.bench.belady import belady
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, read_trace
from moetier.config import format_bytes, parse_budget
from moetier.errors import BudgetError
from moetier.offload.policy import Policy, make_policy

Key = tuple[int, int]  # (layer, expert)


def load_trace(path: str | Path) -> RoutingTrace:
    """Read a moetier-trace file, plain or gzip-compressed (name ends with .gz)."""
    path = Path(path)
    if path.suffix != ".gz":
        return read_trace(path)
    with tempfile.TemporaryDirectory(prefix="moetier-trace-") as tmp:
        plain = Path(tmp) / path.stem
        with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
        return read_trace(plain)


def slots_for_budget(header: TraceHeader, budget: str | int | None) -> int:
    """Device slots the engine would give this trace's model at budget (bytes or a share)."""
    total = len(header.moe_layers) * header.num_experts
    expert_bytes = max(header.expert_bytes, 1)  # a trace without sizes: budgets in experts
    slots = min(parse_budget(budget, total * expert_bytes, "expert budget") // expert_bytes, total)
    if slots < header.top_k:
        raise BudgetError(
            f"expert budget {budget!r} gives {slots} expert slot(s) of "
            f"{format_bytes(expert_bytes)}; one step needs at least top-k = {header.top_k}"
        )
    return int(slots)


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    hits: int
    evictions: list[Key]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 1.0


def simulate(
    records: Sequence[TraceRecord],
    num_slots: int,
    policy: Policy,
    initial: Sequence[Key] = (),
    keep_evictions: bool = False,
) -> ReplayResult:
    """Hits of `policy` on the trace with S slots (engine slot semantics; see module doc)."""
    if num_slots < 1:
        raise ValueError("need at least one slot")
    resident: set[Key] = set()
    for key in list(dict.fromkeys(initial))[:num_slots]:
        resident.add(key)
        policy.insert(key)
    requests = hits = 0
    evictions: list[Key] = []
    for rec in records:
        experts = rec.distinct()
        for w0 in range(0, len(experts), num_slots):
            wave = [(rec.layer, e) for e in experts[w0 : w0 + num_slots]]
            policy.begin_call(rec.layer, experts[w0 : w0 + num_slots])
            in_use = set(wave)
            requests += len(wave)
            for key in wave:
                if key in resident:
                    hits += 1
                    policy.touch(key)
                    continue
                if len(resident) >= num_slots:
                    victim = policy.victim(exclude=in_use)
                    policy.remove(victim)
                    resident.discard(victim)
                    if keep_evictions:
                        evictions.append(victim)
                resident.add(key)
                policy.insert(key)
    return ReplayResult(requests, hits, evictions)


def all_keys(header: TraceHeader) -> list[Key]:
    return [(layer, e) for layer in header.moe_layers for e in range(header.num_experts)]


def replay(
    trace: RoutingTrace, budget: str | int | None, policies: Sequence[str]
) -> tuple[int, float, dict[str, float]]:
    """(slots, Belady's hit rate, {policy: hit rate}) of the trace at the expert budget."""
    slots = slots_for_budget(trace.header, budget)
    keys = all_keys(trace.header)
    initial = keys if slots >= len(keys) else []  # every expert fits: preloaded, as the engine
    rates: dict[str, float] = {}
    for name in policies:
        policy = make_policy(name)
        rates[name] = simulate(trace.records, slots, policy, initial).hit_rate
    best = belady(trace.records, slots, initial=initial).hit_rate
    return slots, best, rates


def format_replay(
    path: str, trace: RoutingTrace, budget: str, slots: int, best: float, rates: dict[str, float]
) -> str:
    h = trace.header
    total = len(h.moe_layers) * h.num_experts
    lines = [
        f"trace {path}: {len(h.moe_layers)} MoE layers x {h.num_experts} experts, top-{h.top_k}; "
        f"{len(trace.records)} layer calls, {len(trace.steps())} steps",
        f"expert budget {budget}: {slots} of {total} expert slots (one global pool)",
        f"{'policy':<10} {'hit rate':>8}  {'vs belady':>9}",
        f"{'belady':<10} {best:>8.4f}  {'':>9}",
    ]
    for name, rate in rates.items():
        lines.append(f"{name:<10} {rate:>8.4f}  {100 * (rate - best):>+7.1f} pt")
    return "\n".join(lines)
