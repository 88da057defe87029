"""CUDA-graph capture and replay of a fresh prompt's prefill, per prompt-length bucket.

Owns the captured prefill graphs, their static input buffers, the padding of a prompt to its
bucket and the rule for when a step may use them; never decides what to schedule or how layers
compute (it replays the same model forward as the eager step).

A step qualifies when it is one fresh prompt computed whole: a single scheduled request with
nothing computed before it (no cached prefix, not a later chunk of a chunked prefill) whose
step reaches its last token and samples, of 2 to the largest bucket's tokens; and, as for
whole decode graphs (engine/graphs.py), every routed expert is resident or the device cache
resolves it, a kernel (slot or grouped) takes the bucket's (token, expert) pairs and no
routing observer is attached. Several prompts in one step run eagerly: their attention spans
(one causal SDPA call each) depend on the lengths, which a graph fixes.

The prompt is padded at the end to its bucket (powers of two from 16 up to
`prefill_graph_max_tokens`, default 512). Pad tokens are token 0 at the positions after the
prompt, and write their K/V into the KV cache's pad slot (a scratch slot past the blocks, in no
block table). Attention stays SDPA `is_causal` (flash on CUDA) over the padded span, so a real
token sees exactly the real tokens before it; the pads attend, route and compute like tokens
but feed nothing back into real rows. Only the last real token's logits are computed (its
index is a static input). What the pads cost: their (token, expert) pairs in the expert
kernels; with the device cache (offload/device_cache.py) their experts are resolved too, so
they may fill slots and they count in its hits and misses (`requests`, `device_hits`,
`host_hits`, `evictions`). The host counters of MoE calls and lookups (`moe_calls_*`,
`token_lookups_*`, `resident_lookups`) count the real tokens only, as the eager step does.
A router fed from the host (the bench's routing override) is staged with the real tokens'
draw and fixed ids for the pads.

Graphs are captured on the first step of each bucket (a warm-up forward, then the capture: that
prompt's step is slower) into their own memory pool; a capture that fails leaves its bucket
eager until a router is swapped. Per step the host copies token ids, KV slots and the last
token's index (one small copy) and launches one graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.engine.batch import SchedulerOutput
from moetier.engine.graphs import graph_key, graph_safe
from moetier.layers.context import ForwardContext, KVBatch, SeqSpan

log = logging.getLogger(__name__)

# Legend: P bucket tokens (the prompt, then pads), V vocabulary.

MIN_BUCKET = 16
PAD_TOKEN = 0  # any id in the vocabulary: a pad's outputs are never read


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """Lengths a prompt is padded to: the powers of two from 16 below `max_tokens`, then
    `max_tokens` itself (at most twice the work of the prompt, few graphs)."""
    assert max_tokens >= 1
    out = []
    b = MIN_BUCKET
    while b < max_tokens:
        out.append(b)
        b *= 2
    out.append(max_tokens)
    return tuple(out)


def bucket_for(tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `tokens`; None above the largest."""
    return next((b for b in buckets if b >= tokens), None)


def fresh_prompt(batch: SchedulerOutput) -> int | None:
    """The token count of a step that is one fresh prompt computed whole (one scheduled request,
    nothing computed before it: no cached prefix, not a later chunk; the step reaches its last
    token and samples); None for any other step. A preempted request recomputing all its
    tokens from 0 in one step is such a prompt too; a one-token prompt is not (its step is
    decode-shaped: engine/graphs.py)."""
    if len(batch.scheduled) != 1:
        return None
    s = batch.scheduled[0]
    if s.request.num_computed_tokens != 0 or not s.samples or s.num_new_tokens < 2:
        return None
    return s.num_new_tokens


def padded_inputs(
    tokens: list[int], table: list[int], block_size: int, bucket: int, pad_slot: int
) -> list[int]:
    """A replay's static inputs, flat [2P + 1]: token ids [P] (the prompt, then PAD_TOKEN),
    their KV slots [P] (position p of the prompt at block table[p // BS], offset p % BS; every
    pad at `pad_slot`), and the index of the last real token [1], whose logits are returned."""
    n = len(tokens)
    assert 1 <= n <= bucket and len(table) * block_size >= n
    pad = bucket - n
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    return [*tokens, *[PAD_TOKEN] * pad, *slots, *[pad_slot] * pad, n - 1]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [2P + 1] int64: token ids, KV slots, last real token's index
    logits: torch.Tensor  # [1, V] float32, written by every replay
    # with the device cache's route log: the MoE calls a replay logs (for the whole bucket)
    routes: list[tuple[int, int, int, int]] = field(default_factory=list)


class PrefillGraphs:
    """Captures the prefill forward of a fresh prompt per bucket and replays it."""

    def __init__(self, runner: Any, max_tokens: int = 512) -> None:
        self.runner = runner
        self.buckets = prefill_buckets(max_tokens)
        self.graphs: dict[int, _Graph] = {}
        self.failed: set[int] = set()  # buckets whose capture failed: eager for good
        self.pool: Any = None  # the graphs' memory pool, made at the first capture
        self.replays = 0
        self.blocks = runner.model.moe_blocks()
        self.moe_layers = len(self.blocks)
        self.top_k = runner.top_k
        self.gates: tuple[tuple[int, bool], ...] = ()  # graph_key of the captured graphs
        self.staged: list[Any] = []  # those routers that are fed from the host (`stage`)
        self._check_routers()

    @property
    def offloaded(self) -> bool:
        """Some MoE layer call needs the host (no resident table, no device cache)."""
        cache = self.runner.expert_cache
        return cache.resident_table is None and cache.device_cache is None

    def bucket(self, batch: SchedulerOutput) -> int | None:
        """The bucket the step replays in; None when it does not qualify (runs eagerly)."""
        n = fresh_prompt(batch)
        if n is None or self.offloaded:
            return None
        bucket = bucket_for(n, self.buckets)
        if bucket is None or not graph_safe(self.blocks, bucket * self.top_k):
            return None
        return bucket

    def qualifies(self, batch: SchedulerOutput) -> bool:
        return self.bucket(batch) is not None

    def run(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits [1, V] of a qualifying step's last prompt token from a graph replay; None =
        run eagerly (the bucket's capture failed, now or before)."""
        self._check_routers()
        bucket = self.bucket(batch)
        assert bucket is not None, "run() only for a step that qualifies()"
        if bucket in self.failed:
            return None
        s = batch.scheduled[0]
        r, n = s.request, s.num_new_tokens
        kv = self.runner.kv_cache
        kv.blocks.allocate(r.request_id, n)
        flat = padded_inputs(
            r.all_token_ids[:n],
            kv.blocks.tables[r.request_id],
            kv.blocks.block_size,
            bucket,
            kv.pad_slot,
        )
        host = torch.tensor(flat, dtype=torch.long)
        for gate in self.staged:  # this step's ids of routers fed from the host
            gate.stage(n, self.runner.device, bucket)
        g = self.graphs.get(bucket)
        if g is None:
            g = self._capture(bucket, host)
            if g is None:
                return None  # the eager step reads the staged ids; the runner unstages them
        try:
            g.inputs.copy_(host, non_blocking=True)
            g.graph.replay()
            if g.routes:  # the prompt's rows of each logged call (the pads' follow them)
                self.runner.expert_cache.device_cache.replayed(
                    [(row, layer, n * k, k) for row, layer, _, k in g.routes]
                )
        finally:
            self.unstage()
        # counted as the eager step counts them: the prompt's tokens, not the pads
        self.runner.stats.count_device_calls(
            n * self.top_k * self.moe_layers,
            self.moe_layers,
            resident=self.runner.expert_cache.device_cache is None,
        )
        self.runner.stats.prefill_graph_replays += 1
        self.replays += 1
        return g.logits.clone()  # the next replay overwrites the graph's output

    def unstage(self) -> None:
        """After an eager step: routers fed from the host draw their ids per call again."""
        for gate in self.staged:
            gate.unstage()

    def _check_routers(self) -> None:
        """A swapped router (the bench's override) drops the graphs captured with the old one."""
        gates = graph_key(self.blocks)
        if gates == self.gates:
            return
        self.graphs.clear()
        self.failed.clear()
        self.gates = gates
        self.staged = [b.gate for b in self.blocks if hasattr(b.gate, "stage")]
        # a fresh pool at the next capture: capturing into the dropped graphs' pool trips an
        # allocator assert (use count 0) in torch 2.11 (see engine/graphs.py)
        self.pool = None

    def _forward(self, inputs: torch.Tensor, p: int) -> torch.Tensor:
        """The prefill forward of one padded prompt over static `inputs` -> logits [1, V]."""
        ids, slots, last = inputs[:p], inputs[p : 2 * p], inputs[2 * p :]
        # [P]: a fresh prompt's positions, the pads' continuing them; a new tensor per forward,
        # so the rotary tables cached per positions tensor are computed inside the capture
        pos = torch.arange(p, device=inputs.device)
        # Nothing cached before the prompt: its history is its own slots, one causal span
        meta = KVBatch(slots, span_slots={0: slots})
        ctx = ForwardContext([SeqSpan(-1, 0, p, 0)], pos, self.runner.kv_cache, meta)
        hidden = self.runner.model(ids, ctx)  # [P, D]
        return self.runner.model.compute_logits(hidden[last])  # [1, V]

    def _capture(self, bucket: int, host: torch.Tensor) -> _Graph | None:
        """Capture the bucket's graph; nothing is computed for the caller (it replays)."""
        device = self.runner.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        inputs = host.to(device)
        stats = self.runner.stats
        counts = stats.save_counts()  # the forwards below count nothing
        cached = self.runner.expert_cache.device_cache
        device_counts = None if cached is None else cached.counters.clone()
        mark = 0 if cached is None else cached.mark()
        routes: list[tuple[int, int, int, int]] = []
        try:
            # Warm-up on a side stream (lazy inits, autotuning), as capture requires; it
            # computes this very step, so the K/V it writes are the ones the replay writes.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(inputs, bucket)
            torch.cuda.current_stream(device).wait_stream(side)
            warm = 0 if cached is None else cached.mark()
            with self.runner.expert_cache.quiet():  # no prefetch thread CUDA call in capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._forward(inputs, bucket)
            if cached is not None:
                routes = cached.rewind(warm)  # logged again by each replay
        except RuntimeError as exc:
            log.warning(
                "prefill of %d-token bucket runs eagerly: capture failed (%s)",
                bucket,
                str(exc).splitlines()[0],
            )
            self.failed.add(bucket)
            torch.cuda.synchronize(device)
            return None
        finally:
            stats.restore_counts(counts)  # the replay (or the eager run) counts this step
            if cached is not None and device_counts is not None:
                # the warm-up's fills are real but uncounted, like its host counts
                cached.counters.copy_(device_counts)
            if cached is not None:
                cached.rewind(mark)  # the replay (or the eager run) logs this step's calls
        g = _Graph(graph, inputs, logits, routes)
        self.graphs[bucket] = g
        log.info("captured prefill graph: %d tokens", bucket)
        return g
