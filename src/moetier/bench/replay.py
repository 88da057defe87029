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

from moetier.bench.belady import BeladyPolicy, belady
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
    """Per call, the predictor's (next MoE layer, experts) after observing that call."""
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


# Streamed prefill steps (layer streaming): loads per step of each policy, with and without the
# step-aware wrapper (`stream_eviction`), beside Belady.


def routing_trace(
    spec: str,
    layers: int | None,
    prompts: int,
    prompt_len: int,
    seed: int = 0,
    output_len: int = 0,
) -> tuple[RoutingTrace, str]:
    """`prompts` prompts one after the other, each a prefill step of `prompt_len` tokens then
    `output_len` decode steps of one token, over `layers` MoE layers (0 .. L-1), routed as
    `moetier bench latency --routing ...` routes a model (bench/routing_override.py): `spec` is
    `uniform:EXK` (seeded uniform top-K of E per token) or a trace file, whose layers are
    cycled onto the L layers and whose per-layer rows are consumed in order, T per call
    (`layers` None: the trace's depth). Prompt p's prefill is step p * (1 + output_len).
    Returns the trace and a label."""
    from moetier.bench.routing_override import RoutingSource, TraceRouting, UniformRouting

    source: RoutingSource
    if spec.startswith("uniform:"):
        try:
            e, k = (int(x) for x in spec.split(":", 1)[1].lower().split("x"))
        except ValueError:
            msg = f"uniform routing is written uniform:EXK (e.g. 128x8), not {spec}"
            raise ConfigError(msg) from None
        source, expert_bytes, depth = UniformRouting(e, k, seed), 0, layers or 1
        label = f"uniform top-{k} of {e} (seed {seed})"
    else:
        base = load_trace(spec)
        e, k, expert_bytes = base.header.num_experts, base.header.top_k, base.header.expert_bytes
        source, depth = TraceRouting(base, e, k, spec), layers or len(base.header.moe_layers)
        label = f"trace {spec} (its layers cycled onto {depth})"
    header = TraceHeader(depth, e, k, list(range(depth)), expert_bytes)
    records = []
    for p in range(prompts):
        for j in range(1 + output_len):
            step, tokens = p * (1 + output_len) + j, prompt_len if j == 0 else 1
            for layer in range(depth):
                rows = source.ids(layer, tokens).tolist()
                records.append(TraceRecord(step, layer, [p] * tokens, rows))
    return RoutingTrace(header, records), label


@dataclass(frozen=True)
class StreamedReplay:
    slots: int
    streamed_calls: int  # calls that stream (the same for every policy: routing decides)
    calls: int
    prefills: list[int]  # each prompt's prefill step; the steps up to the next are its decode
    rows: dict[str, dict[int, int]]  # name -> step -> slot loads (misses + prefetches)


def replay_streamed(
    trace: RoutingTrace, budget: str | int | None, policies: Sequence[str], share: float
) -> StreamedReplay:
    """Slot loads per step with layer streaming at `share` (a prompt's prefill step is the first
    of its steps, each with one record per layer; `routing_trace`): a floor for prefill steps
    (the step's distinct keys less the slots; all of them from cold), Belady on demand loads (a
    lower bound for any schedule, prefetching or not), Belady's rule under the engine's
    streaming, and each policy without and with `stream_eviction` (`step-lru` is always
    step-aware: once)."""
    h = trace.header
    records = trace.records
    slots = slots_for_budget(h, budget)
    keys = all_keys(h)
    initial = keys if slots >= len(keys) else []
    prefills = _prefill_steps(records)
    rows: dict[str, dict[int, int]] = {}
    floor = rows.setdefault("floor: step keys - slots", {})
    for n, s in enumerate(prefills):
        distinct = len({(r.layer, e) for r in records if r.step == s for e in r.distinct()})
        floor[s] = distinct if n == 0 and not initial else max(0, distinct - slots)
    rows["belady, demand (bound)"] = belady(records, slots, initial=initial).step_misses
    stream = Streaming(share, h.num_experts, h.moe_layers, eviction=False)
    oracle = BeladyPolicy(records, slots)
    rows["belady rule, streamed"] = simulate(
        records, slots, oracle, initial, streaming=stream
    ).step_loads
    for name in policies:
        for eviction in (False,) if name == "step-lru" else (False, True):
            run = Streaming(share, h.num_experts, h.moe_layers, eviction=eviction)
            label = f"{name} + stream_eviction" if eviction else name
            result = simulate(records, slots, make_policy(name), initial, streaming=run)
            rows[label] = result.step_loads
    wide = sum(stream.wide(len(r.distinct()), slots) for r in records)
    return StreamedReplay(slots, wide, len(records), prefills, rows)


def _prefill_steps(records: Sequence[TraceRecord]) -> list[int]:
    """Steps whose calls have more than one token, or the first step (`routing_trace`'s
    prompts: each prompt's prefill, then its one-token decode steps)."""
    steps = sorted({r.step for r in records})
    wide = {r.step for r in records if len(r.experts) > 1}
    return [s for i, s in enumerate(steps) if s in wide or i == 0]


def streamed_json(result: StreamedReplay) -> dict[str, object]:
    return {
        "slots": result.slots,
        "streamed_calls": result.streamed_calls,
        "calls": result.calls,
        "prefill_steps": result.prefills,
        "loads": {name: {str(s): n for s, n in per.items()} for name, per in result.rows.items()},
    }


def format_streamed(label: str, trace: RoutingTrace, budget: str, share: float,
                    result: StreamedReplay) -> str:  # fmt: skip
    """Per policy: each prompt's prefill loads, their mean from the second prompt on (warm),
    and the mean decode loads per warm prompt when there are decode steps."""
    h = trace.header
    steps = trace.steps()
    total = len(h.moe_layers) * h.num_experts
    pre = result.prefills
    tokens = len(trace.records[0].experts) if trace.records else 0
    decode = len(steps) - len(pre)
    ends = pre[1:] + [max(steps, default=0) + 1]
    lines = [
        f"streamed replay: {len(h.moe_layers)} MoE layers x {h.num_experts} experts, "
        f"top-{h.top_k}; {len(pre)} prompts of {tokens} tokens"
        + (f", {decode // max(len(pre), 1)} decode steps each" if decode else "")
        + f"; routing: {label}",
        f"expert budget {budget}: {result.slots} of {total} expert slots (one global pool); "
        f"stream share {share}: {result.streamed_calls} of {result.calls} calls stream",
        "slot loads (demand misses + streamed prefetches) of each prompt's prefill step; warm ="
        " mean over prompts 1..; decode = mean loads of a warm prompt's decode steps",
        f"{'':<32}"
        + "".join(f"{'p' + str(n):>7}" for n in range(len(pre)))
        + f"{'warm':>9}"
        + (f"{'decode':>9}" if decode else ""),
    ]
    for name, per in result.rows.items():
        warm = [per.get(s, 0) for s in pre[1:]]
        line = f"{name:<32}" + "".join(f"{per.get(s, 0):>7}" for s in pre)
        line += f"{sum(warm) / len(warm):>9.1f}" if warm else f"{'':>9}"
        if decode and name.startswith("floor"):
            line += f"{'-':>9}"
        elif decode:
            dec = [sum(per.get(t, 0) for t in range(s + 1, e)) for s, e in zip(pre[1:], ends[1:])]
            line += f"{sum(dec) / len(dec):>9.1f}" if dec else f"{'':>9}"
        lines.append(line)
    return "\n".join(lines)
