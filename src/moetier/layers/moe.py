"""MoE block: router top-k, then routed experts computed with weights from an ExpertProvider.

The block does not know where expert weights live; it asks the provider for the distinct
experts the whole step needs, in waves no larger than the provider can hold at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from moetier.kernels.expert_ffn import SILU, ExpertMath, expert_ffn, sum_dtype
from moetier.kernels.grouped_ffn import combine_terms, grouped_ffn, grouped_ffn_terms
from moetier.kernels.slot_layout import SlotLayout
from moetier.offload.types import ExpertBatch, ExpertProvider

if TYPE_CHECKING:
    from moetier.parallel.group import ExpertParallel

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
        # The activation code the expert kernels compute for this block's experts
        # (kernels/expert_ffn.py; `expert_math` adds its parameters; families set their own:
        # gpt-oss, DeepSeek-V4, Gemma 4), None when they cannot: then every call takes the
        # per-expert loop.
        self.kernel_act: int | None = SILU if act == "silu" else None
        self.provider: ExpertProvider | None = None
        self.num_experts = getattr(getattr(gate, "weight", None), "shape", (0,))[0]
        self.weights_dtype_cast = False  # cast routing weights to x.dtype before scaling (Qwen2)
        self.one_token_loop = True  # the per-expert loop's one-token CPU form (False: tests)
        # The per-expert loop's sum: False adds each expert's weighted output into the result
        # in ascending expert order (the reference of most families); True keeps every
        # (token, k) term and sums each token's K terms at once in top-k order, as
        # transformers' grouped_mm experts do (gpt-oss's reference on every device).
        self.topk_sum = False
        # Fast path switches (kernels/): a step with at most `slot_kernel_max_pairs` (token,
        # expert) pairs is computed by the slot-reading kernel (expert_ffn.py), a larger one by
        # the grouped kernel (grouped_ffn.py) when `grouped_kernel` is on; else the per-expert
        # loop (the CPU default). With every expert resident neither adds a host sync.
        self._slot_pairs = 0
        self._grouped = False
        # How the kernels read a slot (dense, or FP8 with block scales); None = dense. Set by
        # the model runner from the expert packing.
        self.slot_layout: SlotLayout | None = None
        # Layer streaming (offloaded, set by the model runner): a call that touches at least
        # this share of the layer's experts prefetches every expert of `next_layer` (the next
        # MoE layer) once its own are fetched, so the copy stream brings layer l+1's misses
        # while layer l computes: a long prompt or large batch needs nearly all of them. 0 = off.
        self.stream_share = 0.0
        self.next_layer: int | None = None
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
        # Expert parallelism (parallel/group.py, set by the model runner): this rank computes
        # the (token, k) terms of its own experts only, one exchange gives every rank all of
        # them, and each adds them as one device would. None = every expert is computed here.
        self.expert_parallel: ExpertParallel | None = None

    # The switches read off for a block whose experts the kernels do not compute (`kernel_act`
    # None), whatever the runner sets, so the block never claims a kernel path it does not
    # take (CUDA graphs capture only blocks whose steps take one).
    @property
    def slot_kernel_max_pairs(self) -> int:
        return self._slot_pairs if self.kernel_act is not None else 0

    @slot_kernel_max_pairs.setter
    def slot_kernel_max_pairs(self, pairs: int) -> None:
        self._slot_pairs = pairs

    @property
    def grouped_kernel(self) -> bool:
        return self._grouped and self.kernel_act is not None

    @grouped_kernel.setter
    def grouped_kernel(self, on: bool) -> None:
        self._grouped = on

    def expert_math(self) -> ExpertMath:
        """What the kernels compute around each expert's matrices (kernels/expert_ffn.py):
        `kernel_act` and the sum of `expert_mlp`'s loop. Families whose experts clamp or carry
        biases override it with their parameters."""
        assert self.kernel_act is not None, "the expert kernels do not compute this block"
        return ExpertMath(self.kernel_act, topk_sum=self.topk_sum)

    def compute(
        self,
        x: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel path's expert compute: x [T, D], slots [T, K] (ascending expert per row),
        weights [T, K], experts [T, K] (their ids, on x's device) -> [T, D]; the slot kernel for
        few pairs, the grouped kernel above."""
        assert self.provider is not None
        inter = self.provider.intermediate
        layout, math = self.slot_layout, self.expert_math()
        if slots.numel() <= self.slot_kernel_max_pairs:
            return expert_ffn(x, pool, slots, weights, inter, layout, math=math, experts=experts)
        return grouped_ffn(
            x, pool, slots, weights, inter, self.num_experts, experts=experts, layout=layout,
            math=math,
        )  # fmt: skip

    def routed(self, x: torch.Tensor, *route_args: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]; `route_args` go to the router after x (DeepSeek-V4's hash
        routers take the step's token ids)."""
        ids, weights = self.gate(x, *route_args)  # [T, K], [T, K]
        if self.weights_dtype_cast:
            weights = weights.to(x.dtype)
        provider = self.provider
        assert provider is not None, "expert provider not attached"
        pairs = ids.numel()
        kernel = pairs > 0 and (pairs <= self.slot_kernel_max_pairs or self.grouped_kernel)
        if self.expert_parallel is not None:
            return self._parallel(x, ids, weights, provider)
        if kernel and self.splitter is not None:
            out: torch.Tensor = self.splitter.split(self, x, ids, weights)
            return out
        cached = provider.device_cache
        if cached is not None and pairs > 0:
            # Residency, policy and miss fills on the device (offload/device_cache.py): no
            # host sync; an observer gets the ids after the step (the route log), or at once
            # when the log cannot hold them.
            if self.route_observer is not None and not cached.log_routes(self.layer, ids):
                self.route_observer(self.layer, ids.flatten().tolist(), ids.shape[1])
            ids, order = ids.sort(dim=-1)
            slots = cached.resolve(self.layer, ids)
            provider.count_resident(pairs, resident=False)
            return self.compute(x, provider.pool, slots, weights.gather(1, order), ids)
        if kernel and provider.resident_table is not None and self.route_observer is None:
            # Every expert is resident: the slot of (layer, expert) is a device table lookup and
            # the host decides nothing, so this layer adds no host sync. (An observer needs the
            # ids on the host: it takes the synced path below, with the same kernel.)
            ids, order = ids.sort(dim=-1)  # ascending expert per token, as the reference adds
            slots = provider.resident_table[self.layer][ids]  # [T, K]
            provider.count_resident(pairs)
            return self.compute(x, provider.pool, slots, weights.gather(1, order), ids)
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
            return self._waves(x, ids, weights, flat, host_ids, provider, kernel)
        batch, slots = wave
        try:  # a raising step must still hand its slots back (the engine keeps serving)
            ids, order = ids.sort(dim=-1)  # ascending expert per token, matching the slot rows
            dev_slots = slots.to(x.device, non_blocking=True)
            return self.compute(x, batch.pool, dev_slots, weights.gather(1, order), ids)
        finally:
            provider.release(batch)

    def _parallel(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, provider: ExpertProvider
    ) -> torch.Tensor:
        """One MoE call on an expert-parallel rank: this rank's experts' terms (the per-expert
        loop, its own experts in waves), every rank's terms by one exchange, then each token's
        terms added in ascending expert order (or its K terms summed at once, `topk_sum`), the
        adds one device makes."""
        ep = self.expert_parallel
        assert ep is not None
        if self.grouped_kernel:
            terms = self._parallel_kernel_terms(x, ids, weights, provider)
            return combine_terms(ep.exchange(terms), self.expert_math())
        k = ids.shape[1]
        flat, host_ids, counts, mine, routing = self._own_experts(ids, provider)
        terms = x.new_zeros(x.shape[0], k, x.shape[1])  # [T, K, D]: zero bits = another rank's
        if mine:
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            order = torch.argsort(flat, stable=True).to(x.device, non_blocking=True)
            tokens, kpos = order // k, order % k
            for w0 in range(0, len(mine), provider.max_batch):
                batch = provider.fetch(self.layer, mine[w0 : w0 + provider.max_batch], routing)
                routing = None
                try:
                    if w0 + provider.max_batch >= len(mine):
                        self._prefetch(host_ids, x)
                    spans = [(offsets[e], offsets[e + 1]) for e in batch.experts]
                    self._wave_loop(x, terms, batch, spans, tokens, kpos, weights, terms)
                finally:
                    provider.release(batch)
        terms = ep.exchange(terms)
        if self.topk_sum:
            return terms.sum(dim=1)
        out = x.new_zeros(x.shape)
        by_expert = ids.sort(dim=-1).indices  # [T, K] each token's terms, ascending expert
        ordered = terms.gather(1, by_expert[:, :, None].expand(-1, -1, x.shape[1]))
        for j in range(k):
            out += ordered[:, j]
        return out

    def _own_experts(
        self, ids: torch.Tensor, provider: ExpertProvider
    ) -> tuple[torch.Tensor, list[int], list[int], list[int], list[list[int]] | None]:
        """The host half of an expert-parallel call: the routing ids on the host (the layer's
        one sync; an observer gets them), (flat ids [T*K], their list, pairs per expert id, this
        rank's experts among them (counted as routed), the policy's routing rows or None)."""
        ep = self.expert_parallel
        assert ep is not None
        k = ids.shape[1]
        t0 = time.perf_counter()
        flat = ids.flatten().cpu()  # [T*K]
        provider.count_routing_sync(time.perf_counter() - t0)
        host_ids: list[int] = flat.tolist()
        if self.route_observer is not None:
            self.route_observer(self.layer, host_ids, k)
        counts = torch.bincount(flat, minlength=1).tolist()
        mine = [e for e, c in enumerate(counts) if c and ep.owns(self.layer, e)]
        if mine:
            provider.count_routed(sum(counts[e] for e in mine), len(mine))
        routing = (
            [host_ids[i : i + k] for i in range(0, len(host_ids), k)]
            if provider.wants_routing and mine
            else None
        )
        return flat, host_ids, counts, mine, routing

    def _parallel_kernel_terms(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, provider: ExpertProvider
    ) -> torch.Tensor:
        """This rank's (token, k) terms [T, K, D] by the grouped kernel, each token's pairs in
        ascending expert order, zero for other ranks' experts: from the rank's device table
        with no host sync when all its experts are resident, else fetched in waves."""
        math = self.expert_math()
        inter, pairs, k = provider.intermediate, ids.numel(), ids.shape[1]
        sorted_ids, by_expert = ids.sort(dim=-1)  # [T, K] ascending expert per token
        sorted_w = weights.gather(1, by_expert)
        table = provider.resident_table
        if table is not None and self.route_observer is None:
            slots = table[self.layer][sorted_ids]  # -1: another rank's expert
            provider.count_resident(pairs)
            return grouped_ffn_terms(
                x, provider.pool, slots, sorted_w, inter, self.num_experts, experts=sorted_ids,
                layout=self.slot_layout, math=math,
            )  # fmt: skip
        _, host_ids, counts, mine, routing = self._own_experts(ids, provider)
        terms = x.new_zeros(x.shape[0], k, x.shape[1])
        for w0 in range(0, len(mine), provider.max_batch):
            batch = provider.fetch(self.layer, mine[w0 : w0 + provider.max_batch], routing)
            routing = None
            try:
                if w0 + provider.max_batch >= len(mine):
                    self._prefetch(host_ids, x)
                batch.ready_all()
                lookup = _slot_lookup(batch, len(counts)).to(x.device, non_blocking=True)
                slots = lookup[sorted_ids]  # [T, K], -1: another wave's or rank's expert
                y = grouped_ffn_terms(
                    x, batch.pool, slots, sorted_w, inter, self.num_experts,
                    experts=sorted_ids, layout=self.slot_layout, math=math,
                )  # fmt: skip
                terms = torch.where((slots >= 0)[:, :, None], y, terms)
            finally:
                provider.release(batch)
        return terms

    def slot_wave(
        self,
        host_ids: list[int],
        k: int,
        provider: ExpertProvider,
        hidden: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, torch.Tensor] | None:
        """Host half of the kernel path: fetch the call's distinct experts in one wave and
        give each token's experts their slots, ascending expert per row ([T, K] int32, CPU).
        None when they do not fit in the slot pool at once (the caller computes in waves). The
        caller releases the batch once the kernel that reads the slots is queued. `hidden`
        (the router input, None in a piecewise-graph replay) goes to the prefetcher."""
        experts = sorted(set(host_ids))
        if len(experts) > provider.max_batch:
            return None
        provider.count_routed(len(host_ids), len(experts))
        rows = torch.tensor(host_ids, dtype=torch.long).view(-1, k).sort(dim=-1).values  # [T, K]
        routing = rows.tolist() if provider.wants_routing else None
        if self._wide(len(experts)):
            provider.streaming(self.layer)
        batch = provider.fetch(self.layer, experts, routing)
        try:
            self._prefetch(host_ids, hidden, len(experts))
            batch.ready_all()  # the kernel reads every slot (late reads: CPU only)
            slots = _slot_lookup(batch, max(experts) + 1)[rows]  # [T, K]
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
        kernel: bool = False,
    ) -> torch.Tensor:
        """Experts fetched in waves no larger than the slot pool, each computed by the grouped
        kernel (`kernel`: its pairs of other waves skipped, adds continuing in ascending expert
        order across waves) or by the per-expert loop."""
        k = ids.shape[1]
        counts = torch.bincount(flat, minlength=1).tolist()
        experts = [e for e, c in enumerate(counts) if c]
        provider.count_routed(flat.numel(), len(experts))
        math = self.expert_math() if kernel else None
        # the running sum across waves: float32 for a kernel's topk_sum (rounded once at the end)
        out = x.new_zeros(x.shape, dtype=sum_dtype(x.dtype, math))
        terms = None  # [T, K, D] each pair's weighted output (topk_sum)
        if self.topk_sum and not kernel:
            terms = x.new_zeros(x.shape[0], k, x.shape[1])
        if math is not None:  # slots per wave from a device lookup; the loop's indexes unneeded
            sorted_ids, by_expert = ids.sort(dim=-1)  # [T, K] ascending expert per token
            sorted_weights = weights.gather(1, by_expert)
        else:  # pairs grouped by expert: each expert's token rows and routing positions
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            order = torch.argsort(flat, stable=True).to(x.device, non_blocking=True)
            tokens, kpos = order // k, order % k
        routing = (  # the call's routing goes with its first wave only
            [host_ids[i : i + k] for i in range(0, len(host_ids), k)]
            if provider.wants_routing
            else None
        )
        if len(experts) <= provider.max_batch and self._wide(len(experts)):
            provider.streaming(self.layer)  # one wave: it streams (see `_prefetch`)
        for w0 in range(0, len(experts), provider.max_batch):
            batch = provider.fetch(self.layer, experts[w0 : w0 + provider.max_batch], routing)
            routing = None
            try:
                if w0 + provider.max_batch >= len(experts):  # the layer's last wave is pinned
                    one_wave = len(experts) <= provider.max_batch  # else nothing to stream into
                    self._prefetch(host_ids, x, len(experts) if one_wave else 0)
                if math is not None:
                    batch.ready_all()
                    lookup = _slot_lookup(batch, len(counts)).to(x.device, non_blocking=True)
                    wave_slots = lookup[sorted_ids]  # [T, K], -1 = another wave's expert
                    grouped_ffn(
                        x, batch.pool, wave_slots, sorted_weights, provider.intermediate,
                        self.num_experts, out, experts=sorted_ids, layout=self.slot_layout,
                        math=math,
                    )  # fmt: skip
                else:
                    spans = [(offsets[e], offsets[e + 1]) for e in batch.experts]
                    self._wave_loop(x, out, batch, spans, tokens, kpos, weights, terms)
            finally:
                provider.release(batch)
        return out.to(x.dtype) if terms is None else terms.sum(dim=1)

    def _prefetch(
        self, host_ids: list[int], hidden: torch.Tensor | None, distinct: int = 0
    ) -> None:
        """Let the prefetcher start the next layers' loads now: this layer's own loads are
        already issued (they go first) and its slots pinned (nothing it needs is evicted).
        A call of `distinct` experts streams the next layer (see `stream_share`)."""
        if self.prefetcher is not None:
            self.prefetcher(self.layer, host_ids, hidden)
        if self.next_layer is not None and self._wide(distinct):
            provider = self.provider
            assert provider is not None and self.next_layer is not None
            loads = provider.prefetch(self.next_layer, range(self.num_experts), streamed=True)
            provider.count_streamed(loads)

    def _wide(self, distinct: int) -> bool:
        """A call of `distinct` experts (in one wave) belongs to a streamed step: it streams the
        next layer, and the provider is told before its fetch (`streaming`) so it can evict in
        the step's order -- the last MoE layer's call too, which has nothing to stream."""
        share = self.stream_share
        return share > 0 and distinct > 0 and distinct >= share * self.num_experts

    def _wave_loop(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        batch: ExpertBatch,
        spans: list[tuple[int, int]],
        tokens: torch.Tensor,
        kpos: torch.Tensor,
        weights: torch.Tensor,
        terms: torch.Tensor | None = None,
    ) -> None:
        """One expert at a time: matches the reference's summation order exactly (with
        `terms` [T, K, D], each pair's term is stored at its (token, k), summed by the caller).
        One token on the CPU skips the per-expert gather of rows and scatter of results (same
        products, same adds in the same order). With late reads (CPU) the experts already in
        place are computed first while the others are read; every expert's term is still added
        in ascending expert order."""
        one = terms is None and self.one_token_loop and x.shape[0] == 1 and not x.is_cuda
        pos = kpos.tolist() if one else []  # each pair's routing slot, pairs ascending
        held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # late batches only
        for i in batch.compute_order():
            batch.ready(i)
            gate_up, down = batch.weights(i)  # after ready(i): a compressed one is decoded
            a, b = spans[i]
            tok = None if one else tokens[a:b]
            rows = x if tok is None else x[tok]
            y = self.expert_mlp(rows, gate_up, down, batch.experts[i])  # [n, D]
            if tok is None:
                term = (y * weights[:, pos[a] : pos[a] + 1]).to(out.dtype)
            else:
                term = (y * weights[tok, kpos[a:b], None]).to(out.dtype)
            if terms is not None:
                assert tok is not None
                terms[tok, kpos[a:b]] = term
            elif batch.late or held:
                held[i] = (tok, term)
            else:
                _add(out, tok, term)
        for i in sorted(held):
            _add(out, *held[i])

    def expert_mlp(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert: int
    ) -> torch.Tensor:
        """One expert on its tokens' rows (the per-expert loop): x [n, D], gate_up [2I, D]
        (gate rows, then up rows), down [D, I] -> [n, D]. A family whose experts compute
        otherwise (gpt-oss: biases and a clamped SwiGLU) overrides it, and `expert_math` to
        match (or sets `kernel_act` None: the kernels then stay off)."""
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
        return F.linear(self.act(g) * u, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x)


def _slot_lookup(batch: ExpertBatch, size: int) -> torch.Tensor:
    """[size] int32 (CPU): the slot of each expert the batch holds, -1 for the others."""
    lookup = torch.full((size,), -1, dtype=torch.int32)
    lookup[torch.tensor(batch.experts, dtype=torch.long)] = torch.tensor(
        batch.slots, dtype=torch.int32
    )
    return lookup


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
