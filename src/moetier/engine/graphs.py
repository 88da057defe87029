"""CUDA-graph capture and replay of the decode step when no layer needs the host.

Owns the captured graphs, their static input buffers and the rule for when a step may use them;
never decides what to schedule or how layers compute (it replays the same model forward).

A decode step qualifies when every scheduled request adds one token and samples, every routed
expert is resident (the MoE layers look slots up on the device: no routing sync), the slot
kernel covers the step's (token, expert) pairs, and no routing observer is attached. Graphs are
keyed by (batch size, history width in KV blocks, rounded up to a power of two) and captured on
first use: per step the host then does one small copy of token ids, lengths and block tables and
one replay, instead of launching every kernel of every layer from Python. Anything else (prefill,
offloaded experts, a capture that fails) runs eagerly, unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from moetier.engine.batch import SchedulerOutput
from moetier.engine.kv_cache import decode_width
from moetier.layers.context import ForwardContext, KVBatch, SeqSpan

log = logging.getLogger(__name__)

# Legend: B decode sequences, W block-table width (blocks), L = W * block size history slots.


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [B * (2 + W)] int64: token ids, lengths, block tables (row-major)
    logits: torch.Tensor  # [B, V] float32, written by every replay


def graph_safe(blocks: list[Any], pairs: int) -> bool:
    """A replayed graph computes what eager would for every MoE block: no host observer of
    the routing, no router fed from the host each call (the bench's routing override; a graph
    would replay its captured ids), and `pairs` (token, expert) pairs fit the slot kernel."""
    return all(
        b.route_observer is None
        and not getattr(b.gate, "host_routing", False)
        and pairs <= b.slot_kernel_max_pairs
        for b in blocks
    )


class DecodeGraphs:
    """Captures the decode forward per (B, W) and replays it for qualifying steps."""

    def __init__(self, runner: Any, max_batch: int = 32) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.failed: set[tuple[int, int]] = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        blocks = runner.model.moe_blocks()
        self.moe_layers = len(blocks)
        self.top_k = runner.top_k

    def qualifies(self, batch: SchedulerOutput) -> bool:
        sched = batch.scheduled
        if not sched or len(sched) > self.max_batch:
            return False
        if self.runner.expert_cache.resident_table is None:
            return False
        if not graph_safe(self.runner.model.moe_blocks(), len(sched) * self.top_k):
            return False
        return all(s.num_new_tokens == 1 and s.samples for s in sched)

    def run(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits [B, V] of a qualifying decode step from a graph replay; None = run eagerly."""
        blocks = self.runner.kv_cache.blocks
        lens, tables = [], []
        for s in batch.scheduled:
            r = s.request
            blocks.allocate(r.request_id, r.num_computed_tokens + 1)
            lens.append(r.num_computed_tokens + 1)
            tables.append(blocks.tables[r.request_id])
        key = (len(lens), decode_width(max(blocks.blocks_for(n) for n in lens)))
        if key in self.failed:
            return None
        ids = [s.request.all_token_ids[s.request.num_computed_tokens] for s in batch.scheduled]
        flat = ids + lens
        for t in tables:
            flat.extend(t[: key[1]] + [0] * (key[1] - len(t[: key[1]])))
        host = torch.tensor(flat, dtype=torch.long)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(key, host)
            if g is None:
                return None
        else:
            g.inputs.copy_(host, non_blocking=True)
            g.graph.replay()
        self.replays += 1
        self.runner.stats.count_device_calls(key[0] * self.top_k * self.moe_layers, self.moe_layers)
        return g.logits.clone()  # the pool is shared: detach the result from the next replay

    def _forward(self, inputs: torch.Tensor, b: int, w: int) -> torch.Tensor:
        """The decode forward over static `inputs`; everything derived on the device."""
        kv = self.runner.kv_cache
        bs = kv.blocks.block_size
        ids, lens = inputs[:b], inputs[b : 2 * b]
        table = inputs[2 * b :].view(b, w)  # [B, W]
        pos = lens - 1  # [B]
        slot_mapping = table.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs  # [B]
        offs = torch.arange(bs, device=inputs.device)
        slots = (table[:, :, None] * bs + offs).flatten(1)  # [B, L]
        mask = torch.arange(w * bs, device=inputs.device)[None, :] < lens[:, None]  # [B, L]
        meta = KVBatch(
            slot_mapping,
            decode_rows=torch.arange(b, device=inputs.device),
            decode_slots=slots.masked_fill(~mask, 0),
            decode_mask=mask[:, None, None, :],
            decode_spans=tuple(range(b)),
            span_slots={},
        )
        # Spans only tell attention that every row is a one-token decode row.
        spans = [SeqSpan(-1 - i, i, i + 1, 0) for i in range(b)]
        hidden = self.runner.model(ids, ForwardContext(spans, pos, kv, meta))  # [B, D]
        return self.runner.model.compute_logits(hidden)  # [B, V]

    def _capture(self, key: tuple[int, int], host: torch.Tensor) -> _Graph | None:
        b, w = key
        device = self.runner.device
        inputs = host.to(device)
        counts = self.runner.stats.save_counts()  # the two forwards below count nothing
        try:
            # Warm-up on a side stream (lazy inits, autotuning), as capture requires; it computes
            # this very step, so the K/V it writes are the ones the replay writes again.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(inputs, b, w)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(inputs, b, w)
        except RuntimeError as exc:
            log.warning("decode step for batch %d, width %d runs eagerly: capture failed (%s)",
                        b, w, str(exc).splitlines()[0])
            self.failed.add(key)
            torch.cuda.synchronize(device)
            self.runner.stats.restore_counts(counts)  # the eager run of this step counts it
            return None
        self.runner.stats.restore_counts(counts)
        graph.replay()
        g = _Graph(graph, inputs, logits)
        self.graphs[key] = g
        log.info("captured decode graph: batch %d, %d KV blocks wide", b, w)
        return g
