"""Replaying streamed prefill steps (layer streaming): slot loads per step of each policy, with
and without the step-aware wrapper (`stream_eviction`, offload/step_aware.py), beside a floor
and Belady. Prompts are synthesized (`routing_trace`: uniform routing or a trace's rows, as
`bench latency --routing` routes a model) and replayed by `bench/replay.py`'s `simulate` under
the engine's streaming (`Streaming`). `moetier replay ... --prompt-len N` prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moetier.bench.belady import BeladyPolicy, belady
from moetier.bench.replay import Streaming, all_keys, load_trace, simulate, slots_for_budget
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord
from moetier.errors import ConfigError
from moetier.offload.policy import make_policy


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
