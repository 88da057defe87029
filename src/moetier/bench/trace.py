"""Routing traces of a run: the types, the JSON Lines file format, and the recorder.

Owns the trace format; it does not decide anything about caching (belady.py simulates on it,
routing_override.py replays it). Format, one JSON object per line:

    {"format": "moetier-trace", "version": 2, "num_layers": L, "num_experts": E, "top_k": K,
     "moe_layers": [...], "expert_bytes": B}
    {"step": s, "layer": l, "requests": [r, ...], "experts": [[e, ...], ...],
     "predicted": [[e, ...], ...]}
    ...

After the header, one line per MoE layer call: `requests` and `experts` have one entry per
token of the batch, in token order (`experts[t]` is token t's top-k ids, router order).

Version 2 adds the optional `predicted`: one row per token, that token's predicted top-k ids
for the NEXT MoE layer's call of the same step (gate lookahead: the next MoE layer's router
applied to this layer's router input, best first). A line without a next MoE layer in its step
(the last MoE layer's) omits it. A file is written as version 2 exactly when some line carries
`predicted`, else as version 1 (no such key anywhere); both versions are read.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "moetier-trace"
VERSION = 2  # the newest version written; VERSIONS are read
VERSIONS = (1, 2)


@dataclass(frozen=True)
class TraceHeader:
    """What the trace was recorded on: model depth, experts per layer, top-k, expert size."""

    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: list[int]
    expert_bytes: int = 0

    def to_json(self, version: int = 1) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": version,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "moe_layers": list(self.moe_layers),
            "expert_bytes": self.expert_bytes,
        }


@dataclass(frozen=True)
class TraceRecord:
    """One MoE layer call: per token, its request id and its top-k expert ids; version 2 may
    add per token the predicted top-k ids of the next MoE layer's call (None: none recorded)."""

    step: int
    layer: int
    requests: list[int]
    experts: list[list[int]]
    predicted: list[list[int]] | None = None

    def distinct(self) -> list[int]:
        """The call's distinct experts, ascending (the order the MoE block fetches them in)."""
        return sorted({e for row in self.experts for e in row})


@dataclass
class RoutingTrace:
    header: TraceHeader
    records: list[TraceRecord] = field(default_factory=list)

    def steps(self) -> list[int]:
        return sorted({r.step for r in self.records})

    def select_steps(self, steps: Iterable[int]) -> list[TraceRecord]:
        keep = set(steps)
        return [r for r in self.records if r.step in keep]

    @property
    def has_predictions(self) -> bool:
        """Whether any call carries recorded next-layer predictions (a version 2 file)."""
        return any(r.predicted is not None for r in self.records)

    @property
    def version(self) -> int:
        """The format version the trace is written as (see the module docstring)."""
        return 2 if self.has_predictions else 1


def write_trace(path: str | Path, trace: RoutingTrace) -> None:
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(trace.header.to_json(trace.version)) + "\n")
        for r in trace.records:
            line: dict[str, Any] = {
                "step": r.step,
                "layer": r.layer,
                "requests": r.requests,
                "experts": r.experts,
            }
            if r.predicted is not None:
                line["predicted"] = r.predicted
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def _lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, json.loads(line)


def read_trace(path: str | Path) -> RoutingTrace:
    """Parse a trace file; a bad header or record raises ConfigError naming the line."""
    from moetier.errors import ConfigError

    it = _lines(path)
    try:
        _, head = next(it)
    except StopIteration:
        raise ConfigError(f"{path}: empty routing trace") from None
    if head.get("format") != FORMAT or head.get("version") not in VERSIONS:
        versions = " or ".join(map(str, VERSIONS))
        raise ConfigError(
            f"{path}: not a {FORMAT} version {versions} file (header {str(head)[:120]})"
        )
    version = int(head["version"])
    header = TraceHeader(
        int(head["num_layers"]),
        int(head["num_experts"]),
        int(head["top_k"]),
        [int(x) for x in head["moe_layers"]],
        int(head.get("expert_bytes", 0)),
    )
    records = []
    for n, obj in it:
        try:
            rec = TraceRecord(
                int(obj["step"]),
                int(obj["layer"]),
                [int(x) for x in obj["requests"]],
                [[int(e) for e in row] for row in obj["experts"]],
                None
                if obj.get("predicted") is None
                else [[int(e) for e in row] for row in obj["predicted"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}:{n}: malformed trace record: {exc}") from exc
        if len(rec.requests) != len(rec.experts):
            raise ConfigError(f"{path}:{n}: requests and experts differ in length")
        if rec.predicted is not None:
            if version < 2:
                raise ConfigError(f"{path}:{n}: `predicted` in a version 1 trace (needs 2)")
            if len(rec.predicted) != len(rec.experts):
                raise ConfigError(f"{path}:{n}: predicted and experts differ in length")
        records.append(rec)
    return RoutingTrace(header, records)


class TraceRecorder:
    """Records every MoE layer call of an engine through `MoEBlock.route_observer`.

    The caller sets `step` and `token_requests` (the request id of each token of the next
    engine step, in token order) before each `engine.step()`; `attach`/`detach` install the
    observer on every MoE block.
    """

    def __init__(self, header: TraceHeader) -> None:
        self.trace = RoutingTrace(header)
        self.step = 0
        self.token_requests: list[int] = []
        self._blocks: list[Any] = []

    def attach(self, blocks: list[Any]) -> None:
        self._blocks = list(blocks)
        for block in self._blocks:
            block.route_observer = self.observe

    def detach(self) -> None:
        for block in self._blocks:
            block.route_observer = None
        self._blocks = []

    def observe(self, layer: int, flat_ids: list[int], k: int) -> None:
        rows = [flat_ids[i : i + k] for i in range(0, len(flat_ids), k)]
        requests = (
            self.token_requests if len(self.token_requests) == len(rows) else [-1] * len(rows)
        )
        self.trace.records.append(TraceRecord(self.step, layer, list(requests), rows))
