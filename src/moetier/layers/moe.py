"""MoE block: router top-k, then routed experts computed with weights from an ExpertProvider.

The block does not know where expert weights live; it asks the provider for the distinct
experts the whole step needs, in waves no larger than the provider can hold at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from moetier.kernels.expert_ffn import expert_ffn
from moetier.offload.types import ExpertBatch, ExpertProvider

# Legend: T tokens, E experts, K top-k, D hidden, I expert intermediate.


class SoftmaxTopKRouter(nn.Module):
    """Softmax over expert logits in float32, top-k, optionally renormalized (Mixtral, Qwen)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, K] int64, weights [T, K] float32."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class MoEBlock(nn.Module):
    """Routed experts of one layer. Families subclass it to add shared experts."""

    def __init__(self, layer: int, gate: nn.Module, act: str = "silu") -> None:
        super().__init__()
        self.layer = layer
        self.gate = gate
        self.act = ACT2FN[act]
        self.act_name = act
        self.provider: ExpertProvider | None = None
        self.weights_dtype_cast = False  # cast routing weights to x.dtype before scaling (Qwen2)
        # Fast path switch: compute a wave with one gather and two bmm when its (token, expert)
        # pairs' weights fit in this many bytes; 0 = always the per-expert loop (CPU default).
        self.grouped_max_bytes = 0
        self.one_token_loop = True  # the per-expert loop's one-token CPU form (False: tests)
        # Fast path switch: compute with the slot-reading kernel (kernels/expert_ffn.py) when the
        # step has at most this many (token, expert) pairs and they fit in the slot pool at once;
        # 0 = off. With every expert resident this path needs no host sync at all.
        self.slot_kernel_max_pairs = 0
        # Called at the layer's routing sync with (layer, flat host expert ids [T*K], K); the
        # bench's trace recorder attaches here. None = nothing observes routing.
        self.route_observer: Callable[[int, list[int], int], None] | None = None
        # Set only while a piecewise CUDA graph is captured (engine/graphs.py): the layer ends
        # the graph at its routing and computes its experts in the next one.
        self.splitter: Any = None
        # Called on the miss path once this layer's experts are fetched (pinned), with (layer,
        # flat host expert ids [T*K], router input [T, D] or None); the prefetcher attaches here
        # (offload/prefetcher.py). Never called on the all-resident path.
        self.prefetcher: Callable[[int, list[int], torch.Tensor | None], None] | None = None

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, K], [T, K]
        if self.weights_dtype_cast:
            weights = weights.to(x.dtype)
        provider = self.provider
        assert provider is not None, "expert provider not attached"
        kernel = 0 < ids.numel() <= self.slot_kernel_max_pairs and self.act_name == "silu"
        if kernel and self.splitter is not None:
            out: torch.Tensor = self.splitter.split(self, x, ids, weights)
            return out
        if kernel and provider.resident_table is not None and self.route_observer is None:
            # Every expert is resident: the slot of (layer, expert) is a device table lookup and
            # the host decides nothing, so this layer adds no host sync. (An observer needs the
            # ids on the host: it takes the synced path below, with the same kernel.)
            ids, order = ids.sort(dim=-1)  # ascending expert per token, as the reference adds
            slots = provider.resident_table[self.layer][ids]  # [T, K]
            provider.count_resident(ids.numel())
            weights = weights.gather(1, order)
            return expert_ffn(x, provider.pool, slots, weights, provider.intermediate)
        k = ids.shape[1]
        # The one host sync of this layer: routing ids to the host to know what to fetch. The
        # host waits here for the GPU to finish everything queued so far: counted, since the
        # all-resident path never pays it.
        t0 = time.perf_counter()
        flat = ids.flatten().cpu()  # [T*K]
        provider.count_routing_sync(time.perf_counter() - t0)
        need_ids = (
            kernel
            or self.route_observer is not None
            or self.prefetcher is not None
            or provider.wants_routing
        )
        host_ids: list[int] = flat.tolist() if need_ids else []
        if self.route_observer is not None:
            self.route_observer(self.layer, host_ids, k)
        wave = self.slot_wave(host_ids, k, provider, x) if kernel else None
        if wave is None:
            return self._waves(x, ids, weights, flat, host_ids, provider)
        batch, slots = wave
        try:  # a raising step must still hand its slots back (the engine keeps serving)
            _, order = ids.sort(dim=-1)  # ascending expert per token, matching the slot rows
            return expert_ffn(
                x,
                batch.pool,
                slots.to(x.device, non_blocking=True),
                weights.gather(1, order),
                provider.intermediate,
            )
        finally:
            provider.release(batch)

    def slot_wave(
        self,
        host_ids: list[int],
        k: int,
        provider: ExpertProvider,
        hidden: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, torch.Tensor] | None:
        """Host half of the slot-kernel path: fetch the call's distinct experts in one wave and
        give each token's experts their slots, ascending expert per row ([T, K] int32, CPU).
        None when they do not fit in the slot pool at once (the caller computes in waves). The
        caller releases the batch once the kernel that reads the slots is queued. `hidden`
        (the router input, None in a piecewise-graph replay) goes to the prefetcher."""
        experts = sorted(set(host_ids))
        if len(experts) > provider.max_batch:
            return None
        provider.count_routed(len(host_ids), len(experts))
        rows = [sorted(host_ids[i : i + k]) for i in range(0, len(host_ids), k)]
        batch = provider.fetch(self.layer, experts, rows if provider.wants_routing else None)
        try:
            self._prefetch(host_ids, hidden)
            batch.ready_all()  # the kernel reads every slot (late reads: CPU only)
            slot_of = dict(zip(batch.experts, batch.slots))
            slots = torch.tensor([[slot_of[e] for e in row] for row in rows], dtype=torch.int32)
        except BaseException:
            provider.release(batch)
            raise
        return batch, slots

    def _waves(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        flat: torch.Tensor,
        host_ids: list[int],
        provider: ExpertProvider,
    ) -> torch.Tensor:
        """Experts fetched in waves no larger than the slot pool, each computed by the grouped
        path or the per-expert loop."""
        k = ids.shape[1]
        order = torch.argsort(flat, stable=True)  # token-major slots grouped by expert
        counts = torch.bincount(flat, minlength=1).tolist()
        experts = [e for e, c in enumerate(counts) if c]
        provider.count_routed(flat.numel(), len(experts))
        offsets = [0]
        for e in range(len(counts)):
            offsets.append(offsets[-1] + counts[e])
        order_dev = order.to(x.device, non_blocking=True)
        tokens, kpos = order_dev // k, order_dev % k
        host_tokens = (order // k).tolist() if self.grouped_max_bytes else []
        out = torch.zeros_like(x)
        routing = (  # the call's routing goes with its first wave only
            [host_ids[i : i + k] for i in range(0, len(host_ids), k)]
            if provider.wants_routing
            else None
        )
        for w0 in range(0, len(experts), provider.max_batch):
            batch = provider.fetch(self.layer, experts[w0 : w0 + provider.max_batch], routing)
            routing = None
            try:
                if w0 + provider.max_batch >= len(experts):  # the layer's last wave is pinned
                    self._prefetch(host_ids, x)
                spans = [(offsets[e], offsets[e + 1]) for e in batch.experts]
                pairs = sum(b - a for a, b in spans)
                nbytes = pairs * batch.pool.shape[1] * x.element_size()
                if nbytes <= self.grouped_max_bytes:
                    self._wave_grouped(x, out, batch, spans, tokens, kpos, weights, host_tokens)
                else:
                    self._wave_loop(x, out, batch, spans, tokens, kpos, weights)
            finally:
                provider.release(batch)
        return out

    def _prefetch(self, host_ids: list[int], hidden: torch.Tensor | None) -> None:
        """Let the prefetcher start the next layers' loads now: this layer's own loads are
        already issued (they go first) and its slots pinned (nothing it needs is evicted)."""
        if self.prefetcher is not None:
            self.prefetcher(self.layer, host_ids, hidden)

    def _wave_loop(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        batch: ExpertBatch,
        spans: list[tuple[int, int]],
        tokens: torch.Tensor,
        kpos: torch.Tensor,
        weights: torch.Tensor,
    ) -> None:
        """One expert at a time: matches the reference's summation order exactly. One token on
        the CPU skips the per-expert gather of rows and scatter of results (same products, same
        adds in the same order). With late reads (CPU) the experts already in place are
        computed first while the others are read; every expert's term is still added in
        ascending expert order."""
        one = self.one_token_loop and x.shape[0] == 1 and not x.is_cuda
        pos = kpos.tolist() if one else []  # each pair's routing slot, pairs ascending
        gate_ups, downs = batch.gate_up, batch.down
        held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # late batches only
        for i in batch.compute_order():
            batch.ready(i)
            a, b = spans[i]
            tok = None if one else tokens[a:b]
            h = F.linear(x if tok is None else x[tok], gate_ups[i])  # [n, 2I]
            g, u = h.chunk(2, dim=-1)
            y = F.linear(self.act(g) * u, downs[i])  # [n, D]
            if tok is None:
                term = (y * weights[:, pos[a] : pos[a] + 1]).to(out.dtype)
            else:
                term = (y * weights[tok, kpos[a:b], None]).to(out.dtype)
            if batch.late or held:
                held[i] = (tok, term)
            else:
                _add(out, tok, term)
        for i in sorted(held):
            _add(out, *held[i])

    def _wave_grouped(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        batch: ExpertBatch,
        spans: list[tuple[int, int]],
        tokens: torch.Tensor,
        kpos: torch.Tensor,
        weights: torch.Tensor,
        host_tokens: list[int],
    ) -> None:
        """All (token, expert) pairs of the wave at once: one weight gather, two bmm.

        A handful of launches instead of ~8 per expert; costs a gather copy of each pair's
        expert weights (bounded by grouped_max_bytes). Each token's expert outputs are added in
        ascending expert order, one rounding per add, exactly like the per-expert loop: in bf16
        a different order flips near-tied routing decisions in later layers.
        """
        batch.ready_all()
        pos = [p for a, b in spans for p in range(a, b)]
        pair_slots = [s for (a, b), s in zip(spans, batch.slots) for _ in range(b - a)]
        # rank = how many of this token's pairs come before it in the wave (ascending expert)
        seen: dict[int, int] = {}
        ranks = []
        for p in pos:
            t = host_tokens[p]
            ranks.append(seen.get(t, 0))
            seen[t] = ranks[-1] + 1
        depth = max(seen.values())
        # One asynchronous copy of all index lists: building each with torch.tensor(...,
        # device=cuda) would synchronize the stream three times per wave, so the host would
        # wait for the expert copies before it could queue this wave's kernels.
        index = torch.tensor([pos, pair_slots, ranks]).to(x.device, non_blocking=True)
        pos_t, slot_t, rank_t = index[0], index[1], index[2]
        tok, kp = tokens[pos_t], kpos[pos_t]  # [P]
        w = batch.pool.index_select(0, slot_t)  # [P, 3ID]
        d = x.shape[1]
        two_i = 2 * (batch.pool.shape[1] // (3 * d))
        gate_up = w[:, : two_i * d].view(-1, two_i, d)  # [P, 2I, D]
        down = w[:, two_i * d :].view(-1, d, two_i // 2)  # [P, D, I]
        h = torch.bmm(gate_up, x[tok].unsqueeze(-1)).squeeze(-1)  # [P, 2I]
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(down, (self.act(g) * u).unsqueeze(-1)).squeeze(-1)  # [P, D]
        y = (y * weights[tok, kp, None]).to(out.dtype)
        per_rank = out.new_zeros(depth, out.shape[0], out.shape[1])  # [R, T, D]
        per_rank[rank_t, tok] = y  # (rank, token) is unique
        for r in range(depth):
            out += per_rank[r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x)


def _add(out: torch.Tensor, tok: torch.Tensor | None, term: torch.Tensor) -> None:
    """Add one expert's weighted output to its tokens' rows (all rows when `tok` is None)."""
    if tok is None:
        out += term
    else:
        out.index_add_(0, tok, term)


def moe_config(config: Any) -> tuple[int, int, int]:
    """(num_experts, top_k, expert intermediate size) from an HF config of any supported family."""
    e = (
        getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    assert e is not None, "config names no expert count"
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return int(e), int(config.num_experts_per_tok), int(inter)
