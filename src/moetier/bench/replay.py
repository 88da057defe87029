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
from dataclasses import dataclass, field
from pathlib import Path

from moetier.bench.belady import belady
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, read_trace
from moetier.config import format_bytes, parse_budget
from moetier.errors import BudgetError, ConfigError
from moetier.offload.policy import Policy, make_policy
from moetier.offload.predict import make_predictor
from moetier.offload.step_aware import StreamEviction

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
    prefetches: int = 0  # keys loaded ahead of their layer's call
    prefetch_used: int = 0  # of those, used by the next call of their layer before eviction
    streamed: int = 0  # of the prefetches, those of layer streaming
    step_loads: dict[int, int] = field(default_factory=dict)  # step -> slot loads in it

    @property
    def loads(self) -> int:
        """Slot loads: demand misses plus prefetches (streamed ones included)."""
        return self.requests - self.hits + self.prefetches

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 1.0

    @property
    def loads_per_lookup(self) -> float:
        """Slot loads (demand misses plus prefetches) per expert lookup: the copy traffic."""
        return (
            (self.requests - self.hits + self.prefetches) / self.requests if self.requests else 0.0
        )


Prefetch = tuple[int, Sequence[int]]  # (target MoE layer, its predicted experts, best first)


@dataclass(frozen=True)
class Streaming:
    """Layer streaming as the engine's MoE block does it (`layers/moe.py`): a call whose
    distinct experts fit the pool at once and number at least `share` x `num_experts` loads
    every expert of the next MoE layer (`moe_layers` order) not resident once its own are in,
    never evicting its own keys or the next layer's, stopping at the first load that finds no
    victim (`ExpertCache.prefetch`). `eviction`: the configured policy is wrapped for such
    calls as the engine's `stream_eviction` does (`offload/step_aware.py`)."""

    share: float
    num_experts: int
    moe_layers: Sequence[int]
    eviction: bool = True

    def wide(self, distinct: int, num_slots: int) -> bool:
        return (
            0 < distinct <= num_slots
            and self.share > 0
            and distinct >= (self.share * self.num_experts)
        )

    def next_layer(self, layer: int) -> int | None:
        later = [la for la in self.moe_layers if la > layer]
        return min(later) if later else None


def simulate(
    records: Sequence[TraceRecord],
    num_slots: int,
    policy: Policy,
    initial: Sequence[Key] = (),
    keep_evictions: bool = False,
    prefetch: Sequence[Prefetch | None] | None = None,
    streaming: Streaming | None = None,
) -> ReplayResult:
    """Hits of `policy` on the trace with S slots (engine slot semantics; see module doc).

    `prefetch[i]` (optional): after call i, its experts of the target layer not resident are
    loaded, best first (at most S), each evicting the policy's victim outside the prefetched
    set; a later lookup that finds one counts as a hit (hit rate at use). `streaming`
    (optional): layer streaming after that, as the engine does it (`Streaming`).
    """
    if num_slots < 1:
        raise ValueError("need at least one slot")
    resident: set[Key] = set()
    for key in list(dict.fromkeys(initial))[:num_slots]:
        resident.add(key)
        policy.insert(key)
    requests = hits = 0
    evictions: list[Key] = []
    fetched: set[Key] = set()  # prefetched keys not yet used
    prefetches = used = streamed = 0
    step_loads: dict[int, int] = {}
    switch = StreamEviction(policy) if streaming is not None and streaming.eviction else None
    current = policy  # the policy of the current call (the switch may wrap `policy`)

    def admit(key: Key, exclude: set[Key]) -> None:
        """Load `key`, evicting the policy's victim outside `exclude` when the pool is full."""
        if len(resident) >= num_slots:
            victim = current.victim(exclude=exclude)
            current.remove(victim)
            resident.discard(victim)
            fetched.discard(victim)
            if keep_evictions:
                evictions.append(victim)
        resident.add(key)
        current.insert(key)

    for i, rec in enumerate(records):
        experts = rec.distinct()
        wide = streaming is not None and streaming.wide(len(experts), num_slots)
        if switch is not None:
            if wide:
                switch.streaming(rec.layer)
            current = switch.call(rec.layer)
        loads_before = requests - hits + prefetches
        for w0 in range(0, len(experts), num_slots):
            wave = [(rec.layer, e) for e in experts[w0 : w0 + num_slots]]
            if w0 == 0:  # the call's routing by request goes with its first wave
                current.begin_call(rec.layer, experts[:num_slots], rec.requests, rec.experts)
            else:
                current.begin_call(rec.layer, experts[w0 : w0 + num_slots])
            in_use = set(wave)
            requests += len(wave)
            for key in wave:
                if key in resident:
                    hits += 1
                    current.touch(key)
                    if key in fetched:
                        used += 1
                        fetched.discard(key)
                    continue
                admit(key, in_use)
        if fetched:  # prefetched for this call and not used by it: wasted
            fetched = {k for k in fetched if k[0] != rec.layer}
        ahead = prefetch[i] if prefetch is not None else None
        if ahead is not None:
            wanted = [(ahead[0], e) for e in ahead[1][:num_slots]]
            busy = set(wanted)
            for key in wanted:
                if key in resident:
                    continue
                admit(key, busy)
                fetched.add(key)
                prefetches += 1
        nxt = streaming.next_layer(rec.layer) if wide and streaming is not None else None
        if nxt is not None and streaming is not None:
            busy = in_use | {(nxt, e) for e in range(streaming.num_experts)}
            for e in range(streaming.num_experts):
                key = (nxt, e)
                if key in resident:
                    continue
                try:
                    admit(key, busy)
                except RuntimeError:  # every resident key is in use: the engine stops here
                    break
                fetched.add(key)
                prefetches += 1
                streamed += 1
        step_loads[rec.step] = step_loads.get(rec.step, 0) + requests - hits + prefetches
        step_loads[rec.step] -= loads_before
    return ReplayResult(requests, hits, evictions, prefetches, used, streamed, step_loads)


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


@dataclass(frozen=True)
class PredictionScore:
    """Next-MoE-layer predictions against the next call's distinct experts, summed over calls
    (micro-averaged), overall and per target layer: (predicted, actual, correct)."""

    predicted: int
    actual: int
    correct: int
    by_layer: dict[int, tuple[int, int, int]]

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.actual if self.actual else 0.0


def predictions(trace: RoutingTrace, name: str) -> list[Prefetch | None]:
    """Per call, the predictor's (next MoE layer, experts) after observing that call. `trace`
    is the predictions recorded in the file itself (version 2; bench/trace_prefetch.py)."""
    from moetier.bench import trace_prefetch

    if name == trace_prefetch.NAME:
        return trace_prefetch.recorded_predictions(trace)
    predictor = make_predictor(name, moe_layers=trace.header.moe_layers)
    if predictor.needs_hidden:
        raise ConfigError(
            f"predictor {name!r} needs hidden states, which a routing trace does not hold; "
            "evaluate it on a model (bench/predictors.py, tests/unit/test_predict_gate.py)"
        )
    if predictor.needs_token_ids:
        raise ConfigError(
            f"predictor {name!r} reads the step's token ids, which a routing trace does not "
            "hold; compare prefetch off and on on a model (tests/models/test_deepseek_v4.py)"
        )
    out: list[Prefetch | None] = []
    for rec in trace.records:
        predictor.observe(rec.layer, [e for row in rec.experts for e in row], rec.requests)
        target = predictor.target_layer(rec.layer)
        out.append(None if target is None else (target, predictor.predict(rec.layer)))
    return out


def score_predictions(
    records: Sequence[TraceRecord], preds: Sequence[Prefetch | None]
) -> PredictionScore:
    """Call i's prediction against call i+1 where that is the predicted layer's call."""
    per: dict[int, list[int]] = {}
    for i in range(len(records) - 1):
        pred, nxt = preds[i], records[i + 1]
        if pred is None or nxt.layer != pred[0]:
            continue
        used = nxt.distinct()
        row = per.setdefault(nxt.layer, [0, 0, 0])
        row[0] += len(pred[1])
        row[1] += len(used)
        row[2] += len(set(pred[1]).intersection(used))
    predicted, actual, correct = (sum(r[j] for r in per.values()) for j in range(3))
    by_layer = {la: (r[0], r[1], r[2]) for la, r in sorted(per.items())}
    return PredictionScore(predicted, actual, correct, by_layer)


@dataclass(frozen=True)
class PredictorReport:
    score: PredictionScore
    prefetch: dict[str, ReplayResult]  # policy -> replay with the predictions prefetched


def replay_predictors(
    trace: RoutingTrace,
    budget: str | int | None,
    predictors: Sequence[str],
    policies: Sequence[str],
) -> dict[str, PredictorReport]:
    """Per predictor: precision and recall of its next-layer predictions, and per policy the
    replay with them prefetched before each next call."""
    slots = slots_for_budget(trace.header, budget)
    keys = all_keys(trace.header)
    initial = keys if slots >= len(keys) else []
    out: dict[str, PredictorReport] = {}
    for name in predictors:
        preds = predictions(trace, name)
        runs = {
            pol: simulate(trace.records, slots, make_policy(pol), initial, prefetch=preds)
            for pol in policies
        }
        out[name] = PredictorReport(score_predictions(trace.records, preds), runs)
    return out


def predictors_json(reports: dict[str, PredictorReport]) -> dict[str, object]:
    return {
        name: {
            "precision": r.score.precision,
            "recall": r.score.recall,
            "by_layer": {
                str(la): {
                    "precision": c / p if p else 0.0,
                    "recall": c / a if a else 0.0,
                }
                for la, (p, a, c) in r.score.by_layer.items()
            },
            "prefetch": {
                pol: {
                    "hit_rate": run.hit_rate,
                    "loads_per_lookup": run.loads_per_lookup,
                    "prefetches": run.prefetches,
                    "prefetch_used": run.prefetch_used,
                }
                for pol, run in r.prefetch.items()
            },
        }
        for name, r in reports.items()
    }


def format_predictors(
    reports: dict[str, PredictorReport], best: float, rates: dict[str, float]
) -> str:
    lines = [
        "next-MoE-layer prediction (each call's prediction vs the next call's experts)",
        f"{'predictor':<14} {'precision':>9} {'recall':>7}",
    ]
    for name, r in reports.items():
        lines.append(f"{name:<14} {r.score.precision:>9.4f} {r.score.recall:>7.4f}")
    lines += [
        "prefetch: predicted experts loaded before the next call, evicting per the policy",
        f"{'predictor':<14} {'policy':<12} {'hit rate':>8} {'vs belady':>9} {'vs alone':>8} "
        f"{'loads/lookup':>12} {'used':>6}",
    ]
    for name, r in reports.items():
        for pol, run in r.prefetch.items():
            used = run.prefetch_used / run.prefetches if run.prefetches else 0.0
            lines.append(
                f"{name:<14} {pol:<12} {run.hit_rate:>8.4f} {100 * (run.hit_rate - best):>+7.1f}pt"
                f" {100 * (run.hit_rate - rates[pol]):>+6.1f}pt {run.loads_per_lookup:>12.4f}"
                f" {used:>6.1%}"
            )
    lines.append(f"(demand only: belady {best:.4f} = {1 - best:.4f} loads/lookup)")
    return "\n".join(lines)
