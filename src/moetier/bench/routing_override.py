"""Bench-only routing override: MoE layers compute a chosen set of experts instead of the router's.

Owns the override sources (seeded uniform draws, replay of a recorded trace) and the gate
wrapper that applies them; never used outside the bench. Deep random-weight stacks route
degenerately (after ~48 random layers the hidden state no longer depends on the token), so
cache results on them need routing that is known to be uniform or known to be real-text.

The wrapper returns the override's ids [T, K] and, as weights, the softmax of the real router
logits gathered at those ids and renormalized, so the compute is the same as for a real router.
Both sources depend only on (layer, call index, tokens in the call), so every expert budget of
one run sees exactly the same routing once `reset()` is called at the start of its timed pass.
Uniform draws are made on the run's device: on CUDA the draw of a 2,048-token prompt (a
[T, E] argsort per MoE layer, 3-7 ms on a host core) would otherwise put host time into every
layer of the timed prefill that the model's own routers never spend. CUDA and CPU draws of one
seed differ; draws on one device repeat exactly. A trace's streams are kept on the run's device
too, and a call's rows are gathered there: a host tensor copied in per layer would be a blocking
copy on the compute stream, so the host would wait each layer for the compute stream, and with it
for the layer's expert loads, before deciding the next layer's (the model's routers never wait
so).

Trace replay onto another shape: model MoE layer i (i-th MoE layer, counting from 0) replays
trace MoE layer `i mod L_trace`; that layer's per-token rows (all records, in file order) form
a stream which each call consumes T rows of, wrapping around at the end. Ids are taken mod the
model's expert count, duplicates dropped, and a row short of K is padded with the next ids
(e+1, e+2, ... mod E) not yet in it, then cut to K. A version 2 trace's recorded next-layer
predictions ride the same stream: `TraceRouting.predicted(i)` gives the predicted rows of
exactly the token rows that layer i's last call replayed, mapped the same way (the `trace`
prefetch predictor, bench/trace_prefetch.py, reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetier.bench.trace import RoutingTrace

# Legend: T tokens, E experts, K top-k, D hidden.


class RoutingSource(Protocol):
    label: str

    def ids(self, index: int, num_tokens: int) -> torch.Tensor:
        """Top-k ids [T, K] int64 per token for the next call of the index-th MoE layer (on the
        CPU, or on the source's device)."""
        ...

    def reset(self) -> None: ...


def uniform_ids(
    seed: int,
    index: int,
    call: int,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[T, K] distinct experts per token, uniformly drawn, from a (seed, layer, call) generator
    on `device` (the ids stay there: no host work or copy on CUDA beyond the launches)."""
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) * 1_000_033 + call)
    draw = torch.rand(num_tokens, num_experts, generator=gen, device=device)  # [T, E]
    return draw.argsort(dim=1)[:, :top_k]


class UniformRouting:
    """Each token draws top-k distinct experts uniformly at random, seeded per layer and call,
    on `device` (the run's device: see the module docstring)."""

    def __init__(
        self, num_experts: int, top_k: int, seed: int, device: torch.device | str = "cpu"
    ) -> None:
        self.num_experts, self.top_k, self.seed = num_experts, top_k, seed
        self.device = torch.device(device)
        where = "" if self.device.type == "cpu" else f", drawn on {self.device.type}"
        self.label = f"uniform (seed {seed}{where})"
        self.calls: dict[int, int] = {}

    def ids(self, index: int, num_tokens: int) -> torch.Tensor:
        call = self.calls.get(index, 0)
        self.calls[index] = call + 1
        return uniform_ids(
            self.seed, index, call, num_tokens, self.num_experts, self.top_k, self.device
        )

    def reset(self) -> None:
        self.calls.clear()


def fit_row(row: list[int], num_experts: int, top_k: int) -> list[int]:
    """A trace row mapped onto E experts, K of them: mod E, deduplicated, padded, cut."""
    out = list(dict.fromkeys(e % num_experts for e in row))
    probe = out[-1] if out else 0
    while len(out) < top_k:
        probe = (probe + 1) % num_experts
        if probe not in out:
            out.append(probe)
    return out[:top_k]


class TraceRouting:
    """Replays a recorded trace's expert ids (layers and tokens cycled; see module docstring)."""

    def __init__(
        self,
        trace: RoutingTrace,
        num_experts: int,
        top_k: int,
        label: str,
        device: torch.device | str = "cpu",
    ) -> None:
        if not trace.records:
            from moetier.errors import ConfigError

            raise ConfigError(f"routing trace {label} has no records")
        self.num_experts, self.top_k, self.label = num_experts, top_k, f"trace {label}"
        layers = trace.header.moe_layers or sorted({r.layer for r in trace.records})
        per_layer = [[r for r in trace.records if r.layer == la] for la in layers]
        per_layer = [recs for recs in per_layer if recs]  # trace layers that have records
        # one [N, K] int64 stream per trace layer that has records, on `device`
        self.streams = [
            torch.tensor(
                [fit_row(row, num_experts, top_k) for r in recs for row in r.experts],
                dtype=torch.long,
                device=device,
            )
            for recs in per_layer
        ]
        # Version 2: per trace layer, its predicted rows aligned with its stream's rows (a token
        # row without a prediction, e.g. the last MoE layer's, is []), mapped as the ids are;
        # None for a layer none of whose calls carries predictions.
        self.has_predictions = trace.has_predictions
        self.predicted_streams: list[list[list[int]] | None] = [
            [
                fit_row(row, num_experts, top_k) if row else []
                for r in recs
                for row in (r.predicted or [[]] * len(r.experts))
            ]
            if any(r.predicted is not None for r in recs)
            else None
            for recs in per_layer
        ]
        self.cursor: dict[int, int] = {}
        self.last_call: dict[int, tuple[int, int]] = {}  # index -> (stream position, T)

    def ids(self, index: int, num_tokens: int) -> torch.Tensor:
        stream = self.streams[index % len(self.streams)]
        pos = self.cursor.get(index, 0)
        self.cursor[index] = pos + num_tokens
        self.last_call[index] = (pos, num_tokens)
        rows = torch.arange(pos, pos + num_tokens, device=stream.device) % stream.shape[0]
        return stream[rows]  # [T, K], on the streams' device

    def predicted(self, index: int) -> list[list[int]]:
        """The recorded next-layer predictions of the token rows that the index-th MoE layer's
        last call replayed, in token order (same stream positions, same id mapping); [] before
        its first call or where the trace layer has none."""
        call = self.last_call.get(index)
        preds = self.predicted_streams[index % len(self.streams)]
        if call is None or preds is None:
            return []
        pos, n = call
        return [preds[(pos + t) % len(preds)] for t in range(n)]

    def reset(self) -> None:
        self.cursor.clear()
        self.last_call.clear()


class OverrideGate(nn.Module):
    """Wraps a router: ids from the override, weights from the real logits at those ids."""

    # Its ids come from the host on every call. A CUDA graph would replay the captured ids
    # forever: before a graph runs, the engine calls `stage` (engine/graphs.py), which copies
    # this call's ids into a fixed device buffer that the captured forward reads.
    host_routing = True

    def __init__(self, inner: nn.Module, source: RoutingSource, index: int) -> None:
        super().__init__()
        self.inner = inner
        self.source = source
        self.index = index
        self.staged: torch.Tensor | None = None  # [T, K] device ids of the staged call
        self._staging: dict[int, torch.Tensor] = {}  # T -> its fixed device buffer

    def stage(self, num_tokens: int, device: torch.device, rows: int | None = None) -> None:
        """Draw the next call's ids for `num_tokens` tokens now, into the fixed buffer of
        `rows` rows (default `num_tokens`). A padded prefill graph (engine/prefill_graphs.py)
        stages its real tokens' draw, as eager would draw it, and gives its pad rows after
        them experts 0 .. K-1."""
        ids = self.source.ids(self.index, num_tokens)  # [T, K]
        rows = num_tokens if rows is None else rows
        if rows > num_tokens:
            pad = torch.arange(ids.shape[1], dtype=ids.dtype, device=ids.device)
            pad = pad.expand(rows - num_tokens, -1)
            ids = torch.cat([ids, pad])  # [rows, K]
        buf = self._staging.get(rows)
        if buf is None:
            buf = self._staging[rows] = torch.empty_like(ids, device=device)
        buf.copy_(ids)
        self.staged = buf

    def unstage(self) -> None:
        self.staged = None

    def forward(
        self, x: torch.Tensor, *route_args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> ids [T, K] int64, weights [T, K] float32. `route_args` (a DeepSeek-V4
        hash router's token ids) are ignored: the override picks hash layers' experts too."""
        if self.staged is not None:
            # a call of fewer tokens than staged rows is the eager run of a padded step whose
            # capture failed: its real tokens are the first rows
            assert self.staged.shape[0] >= x.shape[0], "staged ids for fewer tokens"
            ids = self.staged[: x.shape[0]]
        else:
            ids = self.source.ids(self.index, x.shape[0]).to(x.device)  # [T, K]
        weight: torch.Tensor = self.inner.weight  # type: ignore[assignment]
        probs = F.softmax(F.linear(x.float(), weight.float()), dim=-1)  # [T, E]
        w = probs.gather(1, ids)  # [T, K]
        return ids, w / w.sum(dim=-1, keepdim=True)


def make_source(
    spec: str, num_experts: int, top_k: int, seed: int, device: torch.device | str = "cpu"
) -> RoutingSource | None:
    """`model` -> None (the model's own routers); `uniform` (drawn on `device`); `trace:PATH`."""
    from moetier.errors import ConfigError

    if spec == "model":
        return None
    if spec == "uniform":
        return UniformRouting(num_experts, top_k, seed, device)
    if spec.startswith("trace:"):
        from moetier.bench.trace import read_trace

        path = spec.split(":", 1)[1]
        return TraceRouting(read_trace(path), num_experts, top_k, path, device)
    raise ConfigError(f"unknown routing {spec!r}; use model, uniform or trace:PATH")


def install(blocks: list[Any], source: RoutingSource) -> Callable[[], None]:
    """Wrap every block's gate; returns a function that restores the original gates."""
    originals = [block.gate for block in blocks]
    for i, block in enumerate(blocks):
        block.gate = OverrideGate(block.gate, source, i)

    def undo() -> None:
        for block, gate in zip(blocks, originals):
            block.gate = gate

    return undo
