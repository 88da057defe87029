"""Turns budgets into tiers: how many device slots and host rows, and builds them.

Owns the budget arithmetic and the "budget too small" errors; the tiers themselves live in
store.py and expert_cache.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from moetier.config import Budget, OffloadConfig, format_bytes, parse_budget
from moetier.device_memory import allocate
from moetier.errors import BudgetError, ConfigError
from moetier.offload.device_cache import POLICIES as DEVICE_POLICIES
from moetier.offload.device_cache import DeviceCache
from moetier.offload.expert_cache import ExpertCache
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.offload.types import ExpertKey
from moetier.weights.experts import ExpertLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierPlan:
    """Sizes decided from the budgets (bytes of packed experts as stored: weights/formats.py)."""

    expert_bytes: int
    total_experts: int
    device_slots: int
    host_rows: int

    @property
    def routed_bytes(self) -> int:
        return self.expert_bytes * self.total_experts


def expert_slot_bytes(layout: ExpertLayout, dtype: torch.dtype) -> int:
    """Bytes of one device slot: one packed expert as stored (dense: in the compute dtype;
    compressed: its encoded bytes, weights/formats.py)."""
    return layout.packing(dtype).nbytes


def budget_slots(budget: Budget, expert_bytes: int, total: int, top_k: int) -> int:
    """Device slots an expert budget buys (at most every expert); fewer than top-k is an error."""
    routed = expert_bytes * total
    slots = min(parse_budget(budget, routed, "expert budget") // expert_bytes, total)
    if slots < top_k:
        raise BudgetError(
            f"expert budget {budget!r} gives {slots} expert slot(s) of "
            f"{format_bytes(expert_bytes)}; one step needs at least top-k = {top_k} slots "
            f"({format_bytes(top_k * expert_bytes)}, {100 * top_k / total:.2f}% of routed-expert "
            f"bytes). Raise --expert-budget to at least that."
        )
    return int(slots)


def plan_tiers(
    layout: ExpertLayout, cfg: OffloadConfig, dtype: torch.dtype, top_k: int, device: torch.device
) -> TierPlan:
    expert_bytes = expert_slot_bytes(layout, dtype)
    total = layout.total
    routed = expert_bytes * total
    slots = budget_slots(cfg.expert_budget, expert_bytes, total, top_k)
    host_default = None if device.type == "cuda" else 0
    host_budget = cfg.host_budget if cfg.host_budget is not None else host_default
    host_rows = min(parse_budget(host_budget, routed, "host budget") // expert_bytes, total)
    return TierPlan(expert_bytes, total, slots, int(host_rows))


def build_tiers(
    layout: ExpertLayout,
    cfg: OffloadConfig,
    device: torch.device,
    dtype: torch.dtype,
    top_k: int,
    stats: OffloadStats,
    progress: bool = True,
) -> tuple[ExpertCache, TierPlan]:
    plan = plan_tiers(layout, cfg, dtype, top_k, device)
    pin = cfg.pin_host_memory and device.type == "cuda"
    host = HostTier(layout, plan.host_rows, dtype, pin, stats, progress)

    def place() -> ExpertCache:
        cache = ExpertCache(
            host,
            plan.device_slots,
            device,
            stats,
            cfg.policy,
            chunk_bytes=cfg.transfer_chunk_bytes,
            window=cfg.transfer_window,
            io_threads=cfg.io_threads,
            late_reads=cfg.late_reads,
            stream_eviction=cfg.stream_eviction,
            stream_copy_now=cfg.stream_copy_now,
        )
        if plan.device_slots == plan.total_experts:
            _preload_all(cache, layout, progress)
            # (an expert-parallel rank's table holds its own experts, -1 for the others)
            cache.freeze_resident(max(layout.layers) + 1, layout.num_experts)
        elif cfg.device_cache:
            cache.device_cache = _device_cache(cache, layout, plan, cfg)
        return cache

    cache = allocate(
        device,
        place,
        f"{plan.device_slots} expert slots of {format_bytes(plan.expert_bytes)}",
        lambda: plan.device_slots * plan.expert_bytes,
        lambda free_total: _lower_budget(cfg, plan, free_total),
    )
    if plan.device_slots == plan.total_experts:
        stats.reset()
    log.info(
        "expert tiers: %d/%d experts in device slots (%s), %d in host RAM (%s page-locked), "
        "%s routed in all",
        plan.device_slots,
        plan.total_experts,
        format_bytes(cache.bytes),
        plan.host_rows,
        format_bytes(host.pinned_bytes),
        format_bytes(plan.routed_bytes),
    )
    return cache, plan


def _device_cache(
    cache: ExpertCache, layout: ExpertLayout, plan: TierPlan, cfg: OffloadConfig
) -> DeviceCache:
    """The device-resident cache over `cache`'s slots and host tier; its needs are errors."""
    e = layout.num_experts
    if plan.host_rows < plan.total_experts:
        raise BudgetError(
            f"the device expert cache fills misses from host RAM, which must hold every routed "
            f"expert ({plan.total_experts}; the host budget gives {plan.host_rows} rows): raise "
            f"--host-budget to all of them (the default on CUDA) or drop --device-cache"
        )
    if plan.device_slots < e:
        raise BudgetError(
            f"the device expert cache needs one layer's {e} experts to fit the expert budget "
            f"({plan.device_slots} slots): raise --expert-budget to at least "
            f"{format_bytes(e * plan.expert_bytes)} or drop --device-cache"
        )
    host_row = torch.full((max(layout.layers) + 1, e), -1, dtype=torch.long)
    for key, row in cache.host.index.items():
        host_row[key.layer, key.expert] = row
    if cfg.policy not in DEVICE_POLICIES:
        raise ConfigError(
            f"the device expert cache runs the policies {', '.join(DEVICE_POLICIES)}, not "
            f"{cfg.policy!r}: pick one with --policy or drop --device-cache"
        )
    return DeviceCache(cache.slots, cache.host.pool, host_row, e, plan.expert_bytes, cfg.policy)


def _preload_all(cache: ExpertCache, layout: ExpertLayout, progress: bool) -> None:
    """Every expert fits: fill all slots now so no step waits for a load."""
    keys = layout.owned()
    bar = tqdm(keys, desc="Placing experts on device", unit="expert", disable=not progress)
    for layer, e in bar:
        batch = cache.fetch(layer, [e])
        cache.release(batch)
    if cache.cuda:
        torch.cuda.synchronize(cache.device)
    assert all(ExpertKey(la, e) in cache.slot_of for la, e in keys)


def _lower_budget(cfg: OffloadConfig, plan: TierPlan, free_total: tuple[int, int] | None) -> str:
    """What to do when the slot pool does not fit: the expert budget to lower, and to what."""
    budget = "all experts (the default)" if cfg.expert_budget is None else repr(cfg.expert_budget)
    text = f"Lower --expert-budget (LLM(expert_budget=...)), now {budget}"
    asked = plan.device_slots * plan.expert_bytes
    if free_total is not None and free_total[0] < asked:
        share = 100 * free_total[0] / plan.routed_bytes
        text += (
            f", below the free memory: at most {format_bytes(free_total[0])} "
            f"({share:.0f}% of the {format_bytes(plan.routed_bytes)} of routed experts)"
        )
    return text + ", and leave room for the KV cache (--num-kv-blocks) and activations."
