"""Expert tiers on a tiny checkpoint: packed contents, exact eviction order, exact counters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetier.config import OffloadConfig
from moetier.errors import BudgetError
from moetier.offload.builder import plan_tiers
from moetier.offload.expert_cache import ExpertCache
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.offload.types import ExpertKey
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout
from tests.models.families import MICRO_MIXTRAL
from tests.models.parity import make_checkpoint

TINY = MICRO_MIXTRAL
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> ExpertLayout:
    path = make_checkpoint(tmp_path_factory.mktemp("tiers"), "mixtral", **TINY)
    prefixes = {i: [f"model.layers.{i}.block_sparse_moe"] for i in range(2)}
    return ExpertLayout(Checkpoint(path), prefixes, num_experts=4)


def _cache(layout: ExpertLayout, slots: int, host_rows: int) -> ExpertCache:
    stats = OffloadStats()
    host = HostTier(layout, host_rows, torch.float32, False, stats, progress=False)
    return ExpertCache(host, slots, CPU, stats)


def test_packed_expert_matches_checkpoint(layout: ExpertLayout) -> None:
    tensors = load_file(str(layout.ckpt.model_dir / "model.safetensors"))
    out = torch.empty(layout.shape.numel)
    layout.read_into(1, 3, out)
    gate_up, down = layout.shape.split(out)
    p = "model.layers.1.block_sparse_moe.experts.3"
    assert torch.equal(gate_up[:24], tensors[f"{p}.w1.weight"])
    assert torch.equal(gate_up[24:], tensors[f"{p}.w3.weight"])
    assert torch.equal(down, tensors[f"{p}.w2.weight"])
    assert layout.shape == type(layout.shape)(hidden=16, intermediate=24)


def test_lru_eviction_order_and_counters(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=3, host_rows=0)
    for layer, experts in [(0, [0, 1]), (0, [2]), (0, [0]), (1, [3, 1])]:
        cache.release(cache.fetch(layer, experts))
    # (0,1) and (0,2) were least recent when layer 1 needed two slots
    assert cache.resident() == [ExpertKey(0, 0), ExpertKey(1, 3), ExpertKey(1, 1)]
    s = cache.stats
    assert (s.requests, s.device_hits, s.disk_reads, s.evictions) == (6, 1, 5, 2)
    assert s.bytes_disk_to_host == 5 * 3 * 16 * 24 * 4
    cache.check_integrity()


def test_wave_never_evicts_its_own_experts(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=2, host_rows=0)
    cache.release(cache.fetch(0, [0, 1]))  # unpinned: its slots may be victims now
    batch = cache.fetch(0, [2, 3])
    assert sorted(batch.slots) == [0, 1]
    assert {k.expert for k in cache.resident()} == {2, 3}


def test_host_tier_serves_repeat_misses(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=2, host_rows=3)
    for experts in ([0, 1], [2, 3], [1, 0]):
        cache.release(cache.fetch(0, experts))
    s = cache.stats
    # 0,1,2 from disk; 3 from disk evicts host row of 0; then 1 is a host hit and 0 comes from
    # disk again, evicting host row of 2 (LRU order in the host tier: 2, 3, 1)
    assert (s.disk_reads, s.host_hits, s.host_evictions) == (5, 1, 2)
    # with a host tier every slot fill is a host->slot copy (6 fills)
    assert s.bytes_host_to_device == 6 * layout.shape.numel * 4
    cache.host.check_integrity()


def test_returned_weights_are_the_experts(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=2, host_rows=0)
    batch = cache.fetch(1, [2, 0])
    ref = torch.empty(layout.shape.numel)
    layout.read_into(1, 0, ref)
    assert torch.equal(batch.weights(1)[1], layout.shape.split(ref)[1])


def test_budget_below_top_k_says_minimum(layout: ExpertLayout) -> None:
    with pytest.raises(BudgetError, match=r"at least top-k = 2 slots \(9.00 KiB"):
        plan_tiers(layout, OffloadConfig(expert_budget="2KiB"), torch.float32, 2, CPU)
    plan = plan_tiers(
        layout, OffloadConfig(expert_budget="50%", host_budget="25%"), torch.float32, 2, CPU
    )
    assert (plan.device_slots, plan.host_rows, plan.total_experts) == (4, 2, 8)
    cpu_default = plan_tiers(layout, OffloadConfig(), torch.float32, 2, CPU)
    assert (cpu_default.device_slots, cpu_default.host_rows) == (8, 0)


def test_fetch_stats_reset(layout: ExpertLayout) -> None:
    cache = _cache(layout, slots=2, host_rows=0)
    cache.fetch(0, [1])
    cache.stats.reset()
    assert cache.stats.to_dict()["requests"] == 0


def test_path_type(layout: ExpertLayout) -> None:
    assert isinstance(layout.ckpt.model_dir, Path)
