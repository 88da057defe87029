"""Policies replayed on hand-made traces: exact hits and evictions, and the engine's device tier
making exactly the replay's choices (both call the policy's `begin_call` hook per wave)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from moetier.bench.belady import belady
from moetier.bench.replay import simulate
from moetier.bench.trace import TraceRecord
from moetier.offload.expert_cache import ExpertCache
from moetier.offload.policy import POLICIES, make_policy
from moetier.offload.stats import OffloadStats
from moetier.offload.store import HostTier
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout
from tests.models.families import MICRO_MIXTRAL
from tests.models.parity import make_checkpoint


def _records(calls: list[tuple[int, list[int]]]) -> list[TraceRecord]:
    """One record per (layer, experts of one token); a step ends when the layer index drops."""
    out, step, prev = [], 0, None
    for layer, experts in calls:
        if prev is not None and layer <= prev:
            step += 1
        out.append(TraceRecord(step, layer, [0], [experts]))
        prev = layer
    return out


# 3 layers, top-1, the same expert each step, 2 slots: a step's working set (3) exceeds the pool
CYCLE = _records([(layer, [0]) for _ in range(4) for layer in range(3)])


def test_pool_smaller_than_a_step_lru_thrashes_layer_aware_policies_match_belady() -> None:
    got = {}
    for name in sorted(POLICIES):
        r = simulate(CYCLE, 2, make_policy(name), keep_evictions=True)
        got[name] = (r.hits, r.evictions)
    assert belady(CYCLE, 2).misses == 7  # 5 hits of 12
    assert got == {
        # learns from nothing: step 1 already trusts the reused (0, 0) over (2, 0), whose
        # 0.1 was set before any reuse was seen; from step 2 on it evicts like least-stale
        "activation": (4, [(1, 0), (2, 0), (1, 0), (0, 0), (2, 0), (1, 0)]),
        # quota 2 // 3 layers = 1 and no layer over it: ties go to the layer called most
        # recently (its next call is furthest), as least-stale's do
        "layer-lru": (5, [(1, 0), (0, 0), (2, 0), (1, 0), (0, 0)]),
        "least-stale": (5, [(1, 0), (0, 0), (2, 0), (1, 0), (0, 0)]),
        "lfru": (3, [(1, 0), (2, 0), (1, 0), (2, 0), (1, 0), (2, 0), (1, 0)]),
        # learned nothing yet: every key at the prior, so the layer distance decides, as
        # least-stale's does (Belady's choices here)
        "hazard": (5, [(1, 0), (0, 0), (2, 0), (1, 0), (0, 0)]),
        "lfu": (0, [(0, 0), (1, 0), (2, 0)] * 3 + [(0, 0)]),
        "lru": (0, [(0, 0), (1, 0), (2, 0)] * 3 + [(0, 0)]),
        # the step's next-use order: the layer just finished first (Belady's choices here)
        "step-lru": (5, [(1, 0), (0, 0), (2, 0), (1, 0), (0, 0)]),
    }


# one layer, top-1, 3 slots (tests/demo/test_replay.py: LRU 3/10, LFU 4/10, Belady 5/10)
SEQUENCE = _records([(0, [e]) for e in [0, 0, 0, 1, 2, 3, 0, 2, 1, 3]])


def test_single_layer_sequence_exact_hits() -> None:
    hits = {name: simulate(SEQUENCE, 3, make_policy(name)).hits for name in sorted(POLICIES)}
    # one layer: least-stale, layer-lru and step-lru are LRU; lfru keeps the thrice-used 0 like LFU;
    # activation learns that the reused key comes back and reaches Belady's 5
    assert hits == {
        "activation": 5,
        "hazard": 4,  # learns from 10 lookups only: one above LRU, one below Belady
        "layer-lru": 3,
        "least-stale": 3,
        "lfru": 4,
        "lfu": 4,
        "lru": 3,
        "step-lru": 3,  # one layer: LRU
    }


def _calls(seed: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    return [
        (layer, sorted(rng.sample(range(4), rng.choice((1, 2, 2, 3)))))
        for _ in range(40)
        for layer in range(2)
    ]


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> ExpertLayout:
    path: Path = make_checkpoint(tmp_path_factory.mktemp("policy"), "mixtral", **MICRO_MIXTRAL)
    prefixes = {i: [f"model.layers.{i}.block_sparse_moe"] for i in range(2)}
    return ExpertLayout(Checkpoint(path), prefixes, num_experts=4)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_engine_device_tier_matches_the_replay(layout: ExpertLayout, name: str) -> None:
    calls = _calls(7)
    stats = OffloadStats()
    host = HostTier(layout, 0, torch.float32, False, stats, progress=False)
    cache = ExpertCache(host, 3, torch.device("cpu"), stats, name)
    evicted = []
    victim = cache.policy.victim

    def spy(exclude: set | frozenset = frozenset()) -> object:
        evicted.append(victim(exclude))
        return evicted[-1]

    cache.policy.victim = spy  # type: ignore[method-assign]
    for layer, experts in calls:
        cache.release(cache.fetch(layer, experts))
        cache.check_integrity()
    replayed = simulate(_records(calls), 3, make_policy(name), keep_evictions=True)
    assert (stats.requests, stats.device_hits) == (replayed.requests, replayed.hits)
    assert [tuple(k) for k in evicted] == replayed.evictions
    assert stats.evictions == stats.requests - stats.device_hits - 3
