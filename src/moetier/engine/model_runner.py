"""Loads a checkpoint into a family's model with tiered experts, and runs one batch forward.

Owns the model, the KV cache and the expert tiers; knows nothing of scheduling policy.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moetier.config import CacheConfig, EngineConfig, OffloadConfig
from moetier.device_memory import allocate
from moetier.engine.batch import ScheduledRequest, SchedulerOutput
from moetier.engine.graphs import DecodeGraphs
from moetier.engine.kv_cache import build_kv_cache, kv_bytes_per_token, kv_layout, resolve_kv_format
from moetier.engine.memory_split import MemorySplit, placed_bytes, split_memory
from moetier.engine.prefill_graphs import PrefillGraphs
from moetier.engine.state_cache import RecurrentStateCache, build_state_cache, state_layout
from moetier.errors import CheckpointError, ConfigError
from moetier.kernels.expert_ffn import triton_available
from moetier.kernels.grouped_ffn import SLOT_KERNEL_MAX_PAIRS
from moetier.kernels.slot_layout import MXFP4, slot_layout
from moetier.layers.context import ForwardContext, SeqSpan
from moetier.layers.moe import moe_config
from moetier.layers.norm import RMSNorm
from moetier.layers.rotary import RotaryEmbedding
from moetier.models.registry import Family, get_family
from moetier.offload.builder import TierPlan, build_tiers
from moetier.offload.expert_cache import ExpertCache
from moetier.offload.prefetcher import Prefetcher, build_prefetcher
from moetier.offload.stats import OffloadStats
from moetier.parallel.group import StepPlan
from moetier.parallel.launch import join
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout
from moetier.weights.formats import fp8_block
from moetier.weights.gguf import is_gguf
from moetier.weights.loader import build_model

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}; use 'auto', 'cpu' or 'cuda[:N]'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but CUDA is not available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
    return device


def resolve_dtype(name: str, config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU kernels are fastest and exact in float32
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def load_hf_config(model_dir: Path) -> Any:
    if not model_dir.is_dir():
        raise CheckpointError(
            f"{model_dir}: not a directory; pass a Hugging Face model directory or a .gguf file"
        )
    if not (model_dir / "config.json").exists():
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = f"; to run a GGUF file pass its path, e.g. {model_dir / ggufs[0]}" if ggufs else ""
        raise CheckpointError(
            f"{model_dir}: no config.json; is this a Hugging Face model directory?{hint}"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(
            f"{model_dir}/config.json: cannot be read by transformers: {exc}"
        ) from exc


def load_model_config(path: Path) -> Any:
    """The HF config of a model directory or a GGUF file (its metadata), nothing else read."""
    if is_gguf(path):
        from moetier.weights.gguf import GGUFModel

        return GGUFModel(path).config
    return load_hf_config(path)


def open_model(path: Path) -> tuple[Any, Family, Checkpoint, ExpertLayout]:
    """(HF config, family, checkpoint, expert layout) of a Hugging Face model directory or a
    GGUF file (weights/gguf.py: experts kept in their GGUF block types)."""
    if is_gguf(path):
        from moetier.weights.gguf import GGUFModel

        gguf = GGUFModel(path)
        family = get_family(gguf.config)
        ckpt, gguf_layout = gguf.open(family.expert_prefixes(gguf.config))
        return gguf.config, family, ckpt, gguf_layout  # type: ignore[return-value]
    hf_config = load_hf_config(path)
    family = get_family(hf_config)
    checkpoint = Checkpoint(path)
    layout = ExpertLayout(
        checkpoint,
        family.expert_prefixes(hf_config),
        moe_config(hf_config)[0],
        fp8_block=fp8_block(hf_config),
        interleaved=family.gate_up_interleaved,
    )
    return hf_config, family, checkpoint, layout


def load_generation_config(model_dir: Path) -> Any | None:
    if not model_dir.is_dir() or not (model_dir / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model_dir))
    except (ValueError, OSError) as exc:
        log.warning("%s/generation_config.json ignored: %s", model_dir, exc)
        return None


_NON_EXPERT_FIX = (
    "These stay on the device whatever the budgets: free the memory other processes hold, "
    "pick a smaller --dtype (bfloat16), or use a device with more memory."
)


def _non_expert_bytes(family: Any, hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes of the model's own tensors (everything but routed experts), counted on meta."""
    with torch.device("meta"):
        model = family.build(hf_config)
    size = torch.empty((), dtype=dtype).element_size()
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors)


def _check_parallel(config: EngineConfig) -> None:
    """Settings expert parallelism does not combine with yet: errors that say what to drop."""
    why = None
    if config.offload.device_cache:
        why = "--device-cache (misses resolved on one device)"
    elif config.memory.gpu_memory is not None:
        why = "--gpu-memory (its split counts one device's experts); use --expert-budget"
    if why is not None:
        raise ConfigError(f"--expert-parallel-size > 1 cannot be combined with {why}")


def _new_tokens(s: ScheduledRequest) -> list[int]:
    """The token ids a scheduled request adds this step."""
    start = s.request.num_computed_tokens
    return s.request.all_token_ids[start : start + s.num_new_tokens]


class ModelRunner:
    """Runs the model over a flattened batch of scheduled tokens."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_dir = Path(config.model)
        self.hf_config, family, self.checkpoint, layout = open_model(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.num_experts, self.top_k, _ = moe_config(self.hf_config)
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.model = allocate(
            self.device,
            lambda: build_model(
                family, self.hf_config, self.checkpoint, self.device, self.dtype, config.progress
            ),
            f"the non-expert weights of {self.model_dir} in {dtype_name}",
            lambda: _non_expert_bytes(family, self.hf_config, self.dtype),
            lambda _: _NON_EXPERT_FIX,
        )
        self.max_model_len = config.cache.max_model_len or int(
            getattr(self.hf_config, "max_position_embeddings", None) or 2048
        )
        # Expert parallelism: this rank serves only the experts its placement gives it.
        self.parallel = join(config, layout.layers, self.num_experts)
        if self.parallel is not None:
            _check_parallel(config)
            layout.owns = self.parallel.owns
        offload_cfg, cache_cfg, split = self._split_memory(config, layout)
        self.stats = OffloadStats()
        self.expert_cache: ExpertCache
        self.tier_plan: TierPlan
        self.expert_cache, self.tier_plan = build_tiers(
            layout,
            offload_cfg,
            self.device,
            self.dtype,
            self._min_slots(layout),
            self.stats,
            config.progress,
        )
        kernels = self.device.type == "cuda" and triton_available()
        grouped = config.moe_grouped_kernel
        if grouped is None:
            grouped = kernels
        slot_kernel = config.moe_slot_kernel_max_pairs
        if slot_kernel is None:
            slot_kernel = SLOT_KERNEL_MAX_PAIRS if kernels else 0
        stream = config.moe_stream_share
        if stream is None:
            stream = 0.9 if self.device.type == "cuda" else 0.0
        if self.expert_cache.resident_table is not None:
            stream = 0.0  # every expert resident: nothing to stream
        if self.parallel is not None:
            # Each rank computes its experts' (token, k) terms for the exchange: by the grouped
            # kernel (its terms before the combine) when it is on, else the per-expert loop; the
            # slot kernel combines inside, so it stays off. A rank's own experts are few: the
            # next layer is not streamed either.
            slot_kernel, stream = 0, 0.0
        kernel_layout = slot_layout(self.expert_cache.packing)
        mxfp4 = kernel_layout is not None and any(
            MXFP4 in (v.gate_up_format, v.down_format) for v in kernel_layout.values()
        )
        if mxfp4 and not config.moe_mxfp4_kernel:
            kernel_layout = None  # the kernels' MXFP4 decode turned off: the loop
        if kernel_layout is None:
            # No kernel reads this format: each expert is decoded where the per-expert loop
            # computes it.
            log.info("experts stored as %s: per-expert loop", self.expert_cache.packing.name)
            grouped, slot_kernel = False, 0
        blocks = self.model.moe_blocks()
        for i, block in enumerate(blocks):
            block.provider = self.expert_cache
            block.num_experts = self.num_experts
            block.grouped_kernel = grouped
            block.slot_kernel_max_pairs = slot_kernel
            block.slot_layout = None if kernel_layout is None else kernel_layout[block.layer]
            block.stream_share = stream
            block.next_layer = blocks[i + 1].layer if i + 1 < len(blocks) else None
            block.expert_parallel = self.parallel
        if self.expert_cache.device_cache is not None:
            self._check_device_cache(config, kernel_layout)
            # one step's (token, expert) pairs at most: routing observers read them after it
            self.expert_cache.device_cache.open_route_log(
                config.scheduler.max_num_batched_tokens * self.top_k
            )
        self.prefetcher = self._build_prefetcher(config)
        # every finished, aborted or failed request reaches end_request (engine.py)
        self.expert_cache.policy.ends_reported()
        if self.prefetcher is not None:
            self.prefetcher.predictor.ends_reported()
        fused = config.fused_kernels
        if fused is None:
            fused = self.device.type == "cuda" and triton_available()
        for module in self.model.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.fused = fused
        hybrid = bool(state_layout(self.model))
        if hybrid and cache_cfg.enable_prefix_caching:
            log.info(
                "prefix caching is off for %s: its linear-attention layers keep per-sequence "
                "recurrent state, which a cached K/V prefix does not restore",
                family.name,
            )
            cache_cfg = replace(cache_cfg, enable_prefix_caching=False)
        self.kv_cache = build_kv_cache(
            cache_cfg,
            config.scheduler.max_num_seqs,
            self.max_model_len,
            self.model,
            self.device,
            self.dtype,
        )
        self.memory_split = split or MemorySplit(
            0,
            placed_bytes(self.model),
            0,
            self.tier_plan.device_slots,
            self.tier_plan.expert_bytes,
            self.kv_cache.blocks.num_blocks,
            self.kv_cache.blocks.block_size * self.kv_cache.bytes_per_token,
            "no_gpu_memory",
        )
        # Hybrid models: one recurrent-state slot per sequence that may run at once.
        self.state_cache: RecurrentStateCache | None = build_state_cache(
            self.model, config.scheduler.max_num_seqs, self.device, self.dtype
        )
        self.generation_config = load_generation_config(self.model_dir)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs is not False:
            # The captured decode forward reads no host lengths, which some families' layers
            # need (Family.no_graphs): not graph-safe for them.
            if family.no_graphs is not None:
                log.info("CUDA graphs are off for %s (%s)", family.name, family.no_graphs)
            else:
                self.graphs = DecodeGraphs(self, piecewise=config.piecewise_graphs is not False)
        self.prefill_graphs: PrefillGraphs | None = None
        # Prefill graphs have no state-slot inputs: hybrid models prefill eagerly.
        if (
            self.graphs is not None
            and config.prefill_graphs is not False
            and self.state_cache is None
        ):
            self.prefill_graphs = PrefillGraphs(self, config.prefill_graph_max_tokens)

    def _min_slots(self, layout: ExpertLayout) -> int:
        """The fewest slots one step can run with: top-k, or on an expert-parallel rank the
        most experts of one layer it owns when fewer."""
        if self.parallel is None:
            return self.top_k
        placement, rank = self.parallel.placement, self.parallel.rank
        owned = max(len(placement.experts_of(rank, la)) for la in layout.layers)
        return max(1, min(self.top_k, owned))

    def _split_memory(
        self, config: EngineConfig, layout: ExpertLayout
    ) -> tuple[OffloadConfig, CacheConfig, MemorySplit | None]:
        """With gpu_memory: the slot budget and KV block count its split gives (as explicit
        settings of the builders); without: the settings as they are."""
        if config.memory.gpu_memory is None:
            return config.offload, config.cache, None
        fmt = resolve_kv_format(config.cache.kv_cache_dtype, self.dtype, self.device)
        split = split_memory(
            config,
            self.model,
            layout,
            self.hf_config,
            self.device,
            self.dtype,
            self.top_k,
            self.max_model_len,
            kv_bytes_per_token(kv_layout(self.model), fmt),
            fmt.name,
        )
        offload = replace(config.offload, expert_budget=split.expert_side)
        return offload, replace(config.cache, num_blocks=split.kv_blocks), split

    def _check_device_cache(self, config: EngineConfig, kernel_layout: Any) -> None:
        """The device cache resolves every MoE call for the expert kernels: a model whose
        experts take the per-expert loop, or a prefetcher (host-driven), cannot use it."""
        loop = [b.layer for b in self.model.moe_blocks() if b.kernel_act is None]
        why = None
        if kernel_layout is None:
            why = f"no expert kernel reads experts stored as {self.expert_cache.packing.name}"
        elif loop:
            why = f"MoE layers {loop} use an activation the expert kernels do not fuse"
        elif config.offload.prefetch is not None:
            why = "--prefetch is driven by the host"
        if why is not None:
            raise ConfigError(f"--device-cache cannot be used: {why}; drop --device-cache")

    def after_step(self) -> None:
        """An engine step is done (its tokens read): counters kept on the device reach stats,
        and routing observers get the step's logged calls."""
        cached = self.expert_cache.device_cache
        if cached is not None:
            routes = cached.take_routes()  # empty unless an observer is attached
            if routes:
                blocks = {b.layer: b for b in self.model.moe_blocks()}
                for layer, ids, k in routes:
                    observer = blocks[layer].route_observer
                    if observer is not None:
                        observer(layer, ids, k)
            cached.drain(self.stats)

    def _build_prefetcher(self, config: EngineConfig) -> Prefetcher | None:
        """Next-layer prefetch on the MoE miss path; off when every expert is resident (the
        all-resident path never asks the host anything)."""
        name = config.offload.prefetch
        if name is None or self.expert_cache.resident_table is not None:
            return None
        blocks = self.model.moe_blocks()
        prefetcher = build_prefetcher(
            name, blocks, self.expert_cache, config.offload.prefetch_ahead
        )
        for block in blocks:
            block.prefetcher = prefetcher
        return prefetcher

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Run the scheduled tokens; return float32 logits [N, V] for requests that sample.

        Blocks for the scheduled tokens are allocated here when the scheduler has not already
        (a no-op for scheduled requests); K/V written by a step that raises sits beyond each
        request's progress counter and is overwritten when the request runs again. With expert
        parallelism the step's plan goes to every other rank first, and they run it too.
        """
        if self.prefetcher is not None and self.prefetcher.hash_routes is not None:
            # hash-routed layers' experts follow from the token ids, host ints here: no sync
            self.prefetcher.begin_step([t for s in batch.scheduled for t in _new_tokens(s)])
        self._token_requests([(s.request.request_id, s.num_new_tokens) for s in batch.scheduled])
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None and graphs.qualifies(batch):
                logits = graphs.run(batch)
                if logits is not None:
                    return logits
        plan = self._plan(batch)
        if self.parallel is not None:
            self.parallel.send_step(plan)
        logits = self._run(plan)
        assert logits is not None
        return logits

    def _plan(self, batch: SchedulerOutput) -> StepPlan:
        """The step as plain data (blocks allocated here): what every rank runs."""
        blocks = self.kv_cache.blocks
        spans: list[tuple[int, int, list[int]]] = []
        tables: dict[int, list[int]] = {}
        state_slots: dict[int, int] = {}
        for s in batch.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            chunk = _new_tokens(s)
            blocks.allocate(r.request_id, start + len(chunk))
            spans.append((r.request_id, start, chunk))
            if self.parallel is not None:
                tables[r.request_id] = list(blocks.tables[r.request_id])
                if self.state_cache is not None:
                    state_slots[r.request_id] = self.state_cache.slots.assign(r.request_id)
        return StepPlan(spans, tables, [s.samples for s in batch.scheduled], state_slots)

    def _token_requests(self, spans: list[tuple[int, int]]) -> None:
        """Each token's request (spans: (request id, tokens)), for the predictor and the slot
        policy."""
        cache = self.expert_cache
        if self.prefetcher is not None or cache.wants_routing:
            requests = [rid for rid, n in spans for _ in range(n)]
            if self.prefetcher is not None:
                self.prefetcher.token_requests = requests
            if cache.wants_routing:
                cache.token_requests = requests

    def _run(self, plan: StepPlan, logits: bool = True) -> torch.Tensor | None:
        """The forward of a planned step; the sampling rows' logits (None: `logits` False)."""
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        kv_spans: list[tuple[int, int, int]] = []
        last_rows: list[int] = []
        for (seq, start, chunk), samples in zip(plan.spans, plan.samples):
            spans.append(SeqSpan(seq, len(ids), len(ids) + len(chunk), start))
            kv_spans.append((seq, start, len(chunk)))
            ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            if samples:
                last_rows.append(len(ids) - 1)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        kv_batch = self.kv_cache.build_batch(kv_spans, len(ids))
        if self.state_cache is not None:
            self.state_cache.prepare(kv_spans, kv_batch)
        ctx = ForwardContext(spans, pos, self.kv_cache, kv_batch, states=self.state_cache)
        try:
            hidden = self.model(input_ids, ctx)  # [T, D]
        finally:
            for graphs in (self.graphs, self.prefill_graphs):
                if graphs is not None:  # a failed capture left this step's routing staged
                    graphs.unstage()
        if not logits:
            return None
        rows = torch.tensor(last_rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])  # [N, V]

    @torch.inference_mode()
    def run_remote(self, plan: StepPlan) -> None:
        """A rank other than 0: run the step rank 0 planned, with its block tables and state
        slots (this rank's block manager and slot allocator only hold what the step names)."""
        for seq in plan.ended:
            self.end_request(seq)
        self._token_requests([(seq, len(chunk)) for seq, _, chunk in plan.spans])
        self.kv_cache.blocks.tables = dict(plan.tables)
        if self.state_cache is not None:
            self.state_cache.slots.slot_of = dict(plan.state_slots)
        # counted by step kind as rank 0's engine counts its steps
        decode = all(len(c) == 1 and s for (_, _, c), s in zip(plan.spans, plan.samples))
        self.stats.begin_step(decode)
        try:
            self._run(plan, logits=False)
        finally:
            self.after_step()
            self.stats.end_step()

    def all_rank_stats(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's `rank_stats` (rank 0 first); [] for one rank or a broken
        group."""
        par = self.parallel
        if par is None or par.broken is not None:
            return []
        par.send(("stats",))
        ranks = par.gather(self.rank_stats())
        assert ranks is not None
        return ranks

    def rank_stats(self) -> dict[str, Any]:
        """This rank's expert-tier counters and collective time (offload_stats' `ranks`)."""
        assert self.parallel is not None
        return {
            "rank": self.parallel.rank,
            "owned_experts": self.tier_plan.total_experts,
            "device_slots": self.tier_plan.device_slots,
            **self.stats.to_dict(),
            **self.parallel.stats.to_dict(),
        }

    def free(self, request_id: int) -> int:
        """Free the request's KV blocks (and its state slot); the number of blocks freed."""
        if self.state_cache is not None:
            self.state_cache.free(request_id)
        return self.kv_cache.free(request_id)

    def end_request(self, request_id: int) -> None:
        """The request is finished, aborted or failed: the slot policy and the predictor may
        learn from it (every rank's: the next step tells the others)."""
        if self.parallel is not None and self.parallel.rank == 0:
            self.parallel.ended.append(request_id)
        self.expert_cache.end_request(request_id)
        if self.prefetcher is not None:
            self.prefetcher.end_request(request_id)
