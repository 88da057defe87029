"""Which rank owns each routed expert under expert parallelism.

`round-robin` gives expert e of every layer to rank e % N (expert counts that do not divide by
N leave the low ranks one more). `balanced` places each layer's experts by their popularity in
a routing trace (moetier-trace, `bench/trace.py`): most used first, each to the rank with the
least expected load among those still below ceil(E / N) experts, so every rank holds about
the same number of experts and expects about the same number of (token, expert) pairs.
"""

from __future__ import annotations

from pathlib import Path

from moetier.errors import ConfigError

PLACEMENTS = ("round-robin", "balanced")


class Placement:
    """owner[layer][expert] -> rank, for the MoE layers of one model."""

    def __init__(self, owner: dict[int, list[int]], world: int, name: str) -> None:
        self.owner = owner
        self.world = world
        self.name = name

    def owns(self, rank: int, layer: int, expert: int) -> bool:
        return self.owner[layer][expert] == rank

    def experts_of(self, rank: int, layer: int) -> list[int]:
        return [e for e, r in enumerate(self.owner[layer]) if r == rank]

    def counts(self) -> list[int]:
        """Experts each rank owns, over every MoE layer."""
        out = [0] * self.world
        for row in self.owner.values():
            for r in row:
                out[r] += 1
        return out

    @classmethod
    def round_robin(cls, layers: list[int], num_experts: int, world: int) -> Placement:
        return cls(
            {la: [e % world for e in range(num_experts)] for la in layers}, world, PLACEMENTS[0]
        )

    @classmethod
    def balanced(
        cls, counts: dict[int, list[int]], layers: list[int], num_experts: int, world: int
    ) -> Placement:
        """`counts[layer][expert]`: uses of each expert (a layer missing from `counts` is
        placed as if every expert were used equally)."""
        cap = -(-num_experts // world)  # ceil: no rank holds more than its share of experts
        owner: dict[int, list[int]] = {}
        for la in layers:
            use = counts.get(la, [0] * num_experts)
            load, held = [0] * world, [0] * world
            row = [0] * num_experts
            for e in sorted(range(num_experts), key=lambda e: (-use[e], e)):
                r = min(
                    (r for r in range(world) if held[r] < cap), key=lambda r: (load[r], held[r], r)
                )
                row[e] = r
                load[r] += use[e]
                held[r] += 1
            owner[la] = row
        return cls(owner, world, PLACEMENTS[1])


def trace_counts(path: str | Path, num_experts: int) -> dict[int, list[int]]:
    """Uses of each (layer, expert) over every call in a routing trace."""
    from moetier.bench.trace import read_trace

    try:
        trace = read_trace(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"routing trace {path}: {exc}") from exc
    if trace.header.num_experts != num_experts:
        raise ConfigError(
            f"routing trace {path} was recorded with {trace.header.num_experts} experts a layer; "
            f"this model has {num_experts}: record one with this model (`moetier record-trace`) "
            "or use --expert-placement round-robin"
        )
    counts: dict[int, list[int]] = {}
    for rec in trace.records:
        row = counts.setdefault(rec.layer, [0] * num_experts)
        for experts in rec.experts:
            for e in experts:
                row[e] += 1
    return counts


def make_placement(
    name: str, layers: list[int], num_experts: int, world: int, trace: str | Path | None
) -> Placement:
    if name == "round-robin":
        return Placement.round_robin(layers, num_experts, world)
    if name == "balanced":
        assert trace is not None, "ParallelConfig requires a trace for balanced placement"
        return Placement.balanced(trace_counts(trace, num_experts), layers, num_experts, world)
    raise ConfigError(f"unknown expert placement {name!r}; choose one of {', '.join(PLACEMENTS)}")
