"""The `trace` prefetch predictor: a version 2 routing trace's recorded next-layer predictions.

Owns replaying recorded predictions through the predictor contract (offload/predict.py), so a
predictor can be judged where the model's routers cannot make one: on a random-weight synthetic
checkpoint the routing comes from a trace (`--routing trace:PATH`), while gate lookahead would
apply the random routers. Bench-only: the engine never imports it; `registered()` adds the
name to the predictor registry for the runs of a bench that asks for `--prefetch trace` (and
takes it out again, so the registry outside the bench stays the engine's own).

What it predicts, after the call of model MoE layer `layer`: the union of the `predicted` rows
of exactly the token rows that call replayed (`TraceRouting.predicted`: same stream position,
same `i mod L_trace` layer, same `fit_row` id mapping), ranked by how many tokens predicted
each id, ties in order of first appearance (tokens in order, each row best first). Only for the
next MoE layer of the same step: a row predicts the next layer of its own step, so `ahead` > 1
and the model's last MoE layer (whose next is the next step's first) get nothing, and so does a
trace layer without predictions (the trace's last). No cap at the current call's width: the
recorded rows say what the next layer needs (`limit` still caps).

`moetier replay FILE --predictor trace` scores the same predictor on the file's own calls
(`recorded_predictions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from moetier.errors import ConfigError
from moetier.offload.predict import PREDICTORS, Predictor

if TYPE_CHECKING:
    import torch

    from moetier.bench.replay import Prefetch
    from moetier.bench.trace import RoutingTrace

NAME = "trace"

# the predicted rows of a MoE layer's last call, by the model's layer id
Rows = Callable[[int], Sequence[Sequence[int]]]


def rank_union(rows: Sequence[Sequence[int]]) -> list[int]:
    """Distinct ids of `rows`, most rows first; ties by first appearance (row by row, each row
    in its own order)."""
    count: dict[int, int] = {}
    for row in rows:
        for e in dict.fromkeys(row):  # a row counts an id once
            count[e] = count.get(e, 0) + 1
    return sorted(count, key=lambda e: -count[e])  # sorted is stable: first appearance


class TracePredictor(Predictor):
    """Recorded next-layer predictions (see the module docstring); `rows(layer)` gives the
    predicted rows of `layer`'s call just observed."""

    name = NAME

    def __init__(self, rows: Rows | None = None, moe_layers: Sequence[int] | None = None) -> None:
        super().__init__(moe_layers)
        self.rows: Rows = rows or (lambda layer: [])

    @classmethod
    def from_blocks(cls, blocks: Sequence[Any]) -> TracePredictor:
        """From a model's MoE blocks: a block's rows are those of its gate's trace replay (the
        bench's `OverrideGate` over a `TraceRouting`, installed per measured routing and read
        at each call, so the predictor shares the routing's cursor). A block routed otherwise
        (the model's own routers, e.g. the bench's greedy check) predicts nothing."""
        from moetier.bench.routing_override import TraceRouting

        by_layer = {int(b.layer): b for b in blocks}

        def rows(layer: int) -> Sequence[Sequence[int]]:
            gate = by_layer[layer].gate
            source = getattr(gate, "source", None)
            if not isinstance(source, TraceRouting):
                return []
            return source.predicted(int(gate.index))

        return cls(rows, moe_layers=sorted(by_layer))

    def predict(
        self,
        layer: int,
        ahead: int = 1,
        hidden: torch.Tensor | None = None,
        limit: int | None = None,
    ) -> list[int]:
        target = self.target_layer(layer, ahead)
        if ahead != 1 or target is None or target <= layer:  # not the same step's next layer
            return []
        ranked = rank_union(self.rows(layer))
        return ranked if limit is None else ranked[: max(limit, 0)]


@contextlib.contextmanager
def registered(prefetch: object) -> Iterator[None]:
    """With `prefetch` = trace, `trace` is a predictor name (`build_prefetcher` finds it)
    inside the block, and is taken out of the registry after it."""
    added = prefetch == NAME and NAME not in PREDICTORS
    if added:
        PREDICTORS[NAME] = TracePredictor
    try:
        yield
    finally:
        if added:
            PREDICTORS.pop(NAME, None)


def check_sources(prefetch: object, sources: Sequence[object]) -> None:
    """With `prefetch` = trace every measured routing must replay a version 2 trace (the
    predictions come from it); a clear ConfigError otherwise."""
    if prefetch != NAME:
        return
    from moetier.bench.routing_override import TraceRouting

    for source in sources:
        if not isinstance(source, TraceRouting) or not source.has_predictions:
            what = "the model's routers" if source is None else getattr(source, "label", source)
            raise ConfigError(
                f"--prefetch trace replays the next-layer predictions of a version 2 routing "
                f"trace, and a run routes with {what}: give --routing trace:FILE (only) with a "
                "FILE recorded by `moetier record-trace --predictions`, or pick another "
                "--prefetch"
            )


def recorded_predictions(trace: RoutingTrace) -> list[Prefetch | None]:
    """Per call of the trace, the `trace` predictor's (next MoE layer, experts) after it (as
    `bench.replay.predictions` gives the other predictors'); ConfigError on a version 1 file."""
    if not trace.has_predictions:
        raise ConfigError(
            "predictor 'trace' scores the predictions recorded in a version 2 routing trace, and "
            "this trace has none (version 1): record one with `moetier record-trace "
            "--predictions`"
        )
    current: list[Sequence[Sequence[int]]] = [[]]
    predictor = TracePredictor(lambda layer: current[0], moe_layers=trace.header.moe_layers)
    out: list[Prefetch | None] = []
    for rec in trace.records:
        predictor.observe(rec.layer, [e for row in rec.experts for e in row], rec.requests)
        current[0] = rec.predicted or []
        target = predictor.target_layer(rec.layer)
        out.append(None if target is None else (target, predictor.predict(rec.layer)))
    return out
