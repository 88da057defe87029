"""CUDA-graph capture and replay of decode steps: whole when no layer needs the host, piecewise
around the MoE layers' routing when experts are offloaded.

Owns the captured graphs, their static input buffers and the rule for when a step may use them;
never decides what to schedule or how layers compute (it replays the same model forward).

Whole graphs: a decode step qualifies when every scheduled request adds one token and samples,
every routed expert is resident or the device cache resolves them (offload/device_cache.py:
the MoE layers find or fill their slots on the device: no routing sync),
a kernel (slot or grouped) takes the step's (token, expert) pairs, and no routing observer is
attached.

Piecewise graphs (`piecewise_graphs`): with experts offloaded, each MoE layer ends one graph at
its routing (the sorted top-k ids left in a fixed buffer) and starts the next with its expert
kernel, which reads slot ids from another fixed buffer. Between two replays the host reads the
ids (the layer's one routing sync, as in eager), fetches the missing experts exactly as the eager
path does (`MoEBlock.slot_wave`) and copies the slot ids in. Per layer the host then does one
sync, its cache decisions and one replay instead of launching every kernel from Python. A step
qualifies when, on top of the rules above (resident experts aside), every layer's distinct
experts are sure to fit in the slot pool at once (min(batch x top-k, experts per layer) <=
slots).

Graphs are keyed by (batch size, history width in KV blocks, rounded up to a power of two) and
captured on first use: per step the host does one small copy of token ids, lengths and block
tables (and, for hybrid models, the sequences' recurrent-state slots: the captured Gated DeltaNet
layers gather and scatter their states by those slot ids on the device). Capture computes the
step once eagerly first (lazy inits); recurrent states, unlike K/V writes, are not idempotent, so
the batch's states are saved before that warm-up and restored after it. Anything else (a
capture that fails, prefill but for a fresh prompt's, which engine/prefill_graphs.py replays)
runs eagerly, unchanged. A router fed from the host (the bench's routing override) is staged
before each replay: its ids for this step go into a fixed buffer that the captured forward
reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.engine.batch import SchedulerOutput
from moetier.engine.kv_cache import decode_width
from moetier.layers.context import ForwardContext, KVBatch, SeqSpan

log = logging.getLogger(__name__)

# Legend: B decode sequences, W block-table width (blocks), L = W * block size history slots.


@dataclass
class _Graph:
    graphs: list[torch.cuda.CUDAGraph]  # one (whole) or one per MoE layer + 1 (piecewise)
    # [B * (2 + S + W)] int64: token ids, lengths, state slots (S = 1 for hybrid models, else
    # 0), block tables (row-major)
    inputs: torch.Tensor
    logits: torch.Tensor  # [B, V] float32, written by every replay
    # piecewise only, per MoE layer call in forward order:
    blocks: list[Any] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)  # [B, K] int64 sorted routing ids
    slots: list[torch.Tensor] = field(default_factory=list)  # [B, K] int32 slot ids, host-set
    # whole graphs with the device cache's route log: the MoE calls a replay logs
    routes: list[tuple[int, int, int, int]] = field(default_factory=list)


class _Splitter:
    """Set on every MoE block while a piecewise graph is captured: ends the current graph at
    the block's routing and captures its expert kernel at the start of the next."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.blocks: list[Any] = []
        self.ids: list[torch.Tensor] = []
        self.slots: list[torch.Tensor] = []

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self.graphs.append(g)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def split(
        self, block: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        ids, order = ids.sort(dim=-1)  # ascending expert per token, as the eager path
        weights = weights.gather(1, order)
        slots = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
        self.blocks.append(block)
        self.ids.append(ids)
        self.slots.append(slots)
        self.end()
        self.begin()
        out: torch.Tensor = block.compute(x, block.provider.pool, slots, weights, ids)
        return out


def graph_safe(blocks: list[Any], pairs: int, piecewise: bool = False) -> bool:
    """A replayed graph computes what eager would for every MoE block: no host observer of
    the routing, unless it hears of it another way (piecewise graphs give it the ids at each
    layer's sync; the device cache's route log after the step), any router fed from the host
    can be staged, and a kernel (slot or grouped) takes `pairs` (token, expert) pairs."""
    return all(
        (piecewise or b.route_observer is None or routes_logged(b))
        and (not getattr(b.gate, "host_routing", False) or hasattr(b.gate, "stage"))
        and (pairs <= b.slot_kernel_max_pairs or b.grouped_kernel)
        for b in blocks
    )


def routes_logged(block: Any) -> bool:
    """The block's calls log their routing for observers on the device (no sync in a step)."""
    cached = getattr(getattr(block, "provider", None), "device_cache", None)
    return cached is not None and cached.route_log is not None


def graph_key(blocks: list[Any]) -> tuple[tuple[int, bool], ...]:
    """What the graphs were captured with: each router's identity (the bench swaps them) and
    whether its block is observed (a captured forward logs routes only if it was)."""
    return tuple((id(b.gate), b.route_observer is not None) for b in blocks)


class DecodeGraphs:
    """Captures the decode forward per (B, W) and replays it for qualifying steps."""

    def __init__(self, runner: Any, max_batch: int = 64, piecewise: bool = False) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.piecewise = piecewise
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.failed: set[tuple[int, int]] = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.blocks = runner.model.moe_blocks()
        self.moe_layers = len(self.blocks)
        self.top_k = runner.top_k
        self.gates: tuple[tuple[int, bool], ...] = ()  # graph_key of the captured graphs
        self.staged: list[Any] = []  # those routers that are fed from the host (`stage`)
        self.states = runner.state_cache  # hybrid models' recurrent-state pools, else None

    @property
    def offloaded(self) -> bool:
        """Some MoE layer call needs the host (no resident table, no device cache)."""
        cache = self.runner.expert_cache
        return cache.resident_table is None and cache.device_cache is None

    def qualifies(self, batch: SchedulerOutput) -> bool:
        sched = batch.scheduled
        if not sched or len(sched) > self.max_batch:
            return False
        pairs = len(sched) * self.top_k
        # piecewise: every layer's distinct experts must fit the slot pool in one wave; a layer
        # has at most num_experts of them, however many pairs ask
        distinct = min(pairs, self.runner.num_experts)
        if self.offloaded and (not self.piecewise or distinct > self.runner.expert_cache.max_batch):
            return False
        if not graph_safe(self.blocks, pairs, piecewise=self.offloaded):
            return False
        return all(s.num_new_tokens == 1 and s.samples for s in sched)

    def run(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits [B, V] of a qualifying decode step from graph replays; None = run eagerly."""
        gates = graph_key(self.blocks)
        if gates != self.gates:  # a router was swapped (the bench's override): recapture
            self.graphs.clear()
            self.failed.clear()
            self.gates = gates
            self.staged = [b.gate for b in self.blocks if hasattr(b.gate, "stage")]
            # a fresh memory pool: capturing into the dropped graphs' pool trips an allocator
            # assert (use count 0) in torch 2.11
            self.pool = torch.cuda.graph_pool_handle()
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
        if self.states is not None:
            rids = [s.request.request_id for s in batch.scheduled]
            state_slots = [self.states.slots.assign(r) for r in rids]
            # a one-token prompt's first step is a decode step too: its states start at zero
            self.states.zero(
                [
                    q
                    for q, s in zip(state_slots, batch.scheduled)
                    if s.request.num_computed_tokens == 0
                ]
            )
            flat += state_slots
        for t in tables:
            flat.extend(t[: key[1]] + [0] * (key[1] - len(t[: key[1]])))
        host = torch.tensor(flat, dtype=torch.long)
        for gate in self.staged:  # this step's ids of routers fed from the host
            gate.stage(key[0], self.runner.device)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(key, host)
            if g is None:
                return None  # the eager step reads the staged ids; the runner unstages them
        try:
            g.inputs.copy_(host, non_blocking=True)
            if g.blocks:
                self._replay_pieces(g, key[0])
            else:
                g.graphs[0].replay()
                if g.routes:
                    self.runner.expert_cache.device_cache.replayed(g.routes)
                self.runner.stats.count_device_calls(
                    key[0] * self.top_k * self.moe_layers,
                    self.moe_layers,
                    resident=self.runner.expert_cache.device_cache is None,
                )
        finally:
            for gate in self.staged:
                gate.unstage()
        self.replays += 1
        self.runner.stats.decode_graph_replays += 1
        return g.logits.clone()  # the pool is shared: detach the result from the next replay

    def unstage(self) -> None:
        """After an eager step: routers fed from the host draw their ids per call again."""
        for gate in self.staged:  # only run() stages, and it refreshes this list first
            gate.unstage()

    def _replay_pieces(self, g: _Graph, b: int) -> None:
        """Replay the pieces; between two, the host does a MoE layer's routing sync and fetch."""
        provider = self.runner.expert_cache
        pending = None  # the previous layer's fetched experts, released once its kernel is queued
        try:
            for i, graph in enumerate(g.graphs):
                graph.replay()
                if pending is not None:
                    provider.release(pending)
                    pending = None
                if i == len(g.blocks):
                    break
                block = g.blocks[i]
                t0 = time.perf_counter()
                host_ids = g.ids[i].flatten().tolist()  # the layer's one routing sync
                provider.count_routing_sync(time.perf_counter() - t0)
                if block.route_observer is not None:
                    block.route_observer(block.layer, host_ids, self.top_k)
                wave = block.slot_wave(host_ids, self.top_k, provider)
                assert wave is not None, "qualifies() checked that a step's experts fit"
                pending, slots = wave
                g.slots[i].copy_(slots, non_blocking=True)
        finally:
            if pending is not None:
                provider.release(pending)

    def _forward(self, inputs: torch.Tensor, b: int, w: int) -> torch.Tensor:
        """The decode forward over static `inputs`; everything derived on the device."""
        kv = self.runner.kv_cache
        bs = kv.blocks.block_size
        ids, lens = inputs[:b], inputs[b : 2 * b]
        hybrid = self.states is not None
        state_slots = inputs[2 * b : 3 * b] if hybrid else None
        table = inputs[(3 if hybrid else 2) * b :].view(b, w)  # [B, W]
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
            decode_state_slots=state_slots,
        )
        # Spans only tell attention that every row is a one-token decode row.
        spans = [SeqSpan(-1 - i, i, i + 1, 0) for i in range(b)]
        ctx = ForwardContext(spans, pos, kv, meta, states=self.states)
        hidden = self.runner.model(ids, ctx)  # [B, D]
        return self.runner.model.compute_logits(hidden)  # [B, V]

    def _capture(self, key: tuple[int, int], host: torch.Tensor) -> _Graph | None:
        """Capture the step's graph(s); nothing is computed (the caller replays them)."""
        b, w = key
        device = self.runner.device
        inputs = host.to(device)
        counts = self.runner.stats.save_counts()  # the forwards below count nothing
        cached = self.runner.expert_cache.device_cache
        device_counts = None if cached is None else cached.counters.clone()
        mark = 0 if cached is None else cached.mark()
        routes: list[tuple[int, int, int, int]] = []
        splitter = _Splitter(self.pool) if self.offloaded else None
        try:
            # Warm-up on a side stream (lazy inits, autotuning), as capture requires; it computes
            # this very step eagerly (fetching what it misses), so the K/V it writes are the
            # ones the replay writes again.
            saved = None if self.states is None else self.states.save(inputs[2 * b : 3 * b])
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(inputs, b, w)
            torch.cuda.current_stream(device).wait_stream(side)
            if saved is not None:  # the replay (or the eager step) advances them once
                self.states.restore(saved)
            warm = 0 if cached is None else cached.mark()
            with self.runner.expert_cache.quiet():  # no prefetch thread CUDA call in capture
                if splitter is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        logits = self._forward(inputs, b, w)
                    if cached is not None:
                        routes = cached.rewind(warm)  # logged again by each replay
                    g = _Graph([graph], inputs, logits, routes=routes)
                else:
                    g = self._capture_pieces(splitter, inputs, b, w)
        except RuntimeError as exc:
            log.warning(
                "decode step for batch %d, width %d runs eagerly: capture failed (%s)",
                b,
                w,
                str(exc).splitlines()[0],
            )
            self.failed.add(key)
            torch.cuda.synchronize(device)
            self.runner.stats.restore_counts(counts)  # the eager run of this step counts it
            if cached is not None and device_counts is not None:
                cached.counters.copy_(device_counts)
            return None
        finally:
            for block in self.blocks:
                block.splitter = None
            if cached is not None:
                cached.rewind(mark)  # the replay (or the eager run) logs this step's calls
        self.runner.stats.restore_counts(counts)
        if cached is not None and device_counts is not None:
            # the warm-up's fills are real but uncounted, like its host counts: the replay that
            # follows counts this step (as hits)
            cached.counters.copy_(device_counts)
        self.graphs[key] = g
        log.info(
            "captured decode graph%s: batch %d, %d KV blocks wide",
            f" in {len(g.graphs)} pieces" if g.blocks else "",
            b,
            w,
        )
        return g

    def _capture_pieces(self, splitter: _Splitter, inputs: torch.Tensor, b: int, w: int) -> _Graph:
        device = self.runner.device
        for block in self.blocks:
            block.splitter = splitter
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            splitter.begin()
            try:
                logits = self._forward(inputs, b, w)
            finally:
                splitter.end()
        torch.cuda.current_stream(device).wait_stream(stream)
        if len(splitter.blocks) != self.moe_layers:
            raise RuntimeError(
                f"piecewise capture split at {len(splitter.blocks)} of {self.moe_layers} MoE layers"
            )
        return _Graph(
            splitter.graphs, inputs, logits, splitter.blocks, splitter.ids, splitter.slots
        )
