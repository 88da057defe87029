"""Step-aware eviction (offload/step_aware.py): exact victim orders, the switch that wraps the
configured policy for streamed calls only, streamed replays' exact load counts against LRU and
Belady, and the engine's device tier making exactly the replay's choices while streaming."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from moetier.bench.belady import BeladyPolicy, belady
from moetier.bench.replay import Streaming, simulate
from moetier.bench.trace import TraceRecord
from moetier.offload.expert_cache import ExpertCache
from moetier.offload.policy import LRUPolicy, make_policy
from moetier.offload.stats import OffloadStats
from moetier.offload.step_aware import StepAwarePolicy, StreamEviction
from moetier.offload.store import HostTier
from moetier.offload.types import ExpertKey
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout
from tests.models.families import MICRO_MIXTRAL
from tests.models.parity import make_checkpoint


def _fill(p: StepAwarePolicy, layers: range, experts: int = 2) -> None:
    for layer in layers:
        p.begin_call(layer, list(range(experts)))
        for e in range(experts):
            p.insert((layer, e))


def test_victims_finished_latest_first_then_farthest_ahead_then_current() -> None:
    p = StepAwarePolicy(always=True)
    _fill(p, range(5))  # a step so far: layers 0 .. 4
    p.begin_call(2, [])  # the next step is at layer 2: 0 and 1 finished, 3 and 4 ahead
    assert p.order() == [
        (1, 0), (1, 1),  # the layer just finished: needed last in the next step
        (0, 0), (0, 1),
        (4, 0), (4, 1),  # ahead, the farthest first
        (3, 0), (3, 1),
        (2, 0), (2, 1),  # the current layer last
    ]  # fmt: skip
    assert p.victim() == (1, 0)
    p.touch((1, 0))  # LRU within a layer
    assert p.order()[:2] == [(1, 1), (1, 0)]
    assert p.victim(exclude={(1, 1), (1, 0), (0, 0)}) == (0, 1)  # never an excluded key
    p.begin_call(0, [])  # a new step: every other layer is ahead
    assert [k[0] for k in p.order()[::2]] == [4, 3, 2, 1, 0]
    for key in p.order():
        p.remove(key)
    with pytest.raises(RuntimeError, match="in use"):
        p.victim()


def test_switch_wraps_only_streamed_calls_and_decode_keeps_the_base_order() -> None:
    base = LRUPolicy()
    switch = StreamEviction(base)
    assert switch.call(0) is base  # not announced: the configured policy itself
    for layer in range(3):
        base.begin_call(layer, [0])
        base.insert((layer, 0))
    switch.streaming(1)
    wrapped = switch.call(1)
    assert wrapped is switch.step_aware and wrapped.active
    wrapped.begin_call(1, [0])
    assert wrapped.victim() == (0, 0)  # finished layer 0 (LRU would also say (0, 0))
    assert wrapped.victim(exclude={(0, 0)}) == (2, 0)  # then ahead, not the current (1, 0)
    assert base.victim(exclude={(0, 0)}) == (1, 0)  # what LRU alone would evict
    wrapped.insert((3, 0))  # forwarded: the base stays exact
    assert base.order() == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert switch.call(2) is base and not switch.step_aware.active  # a decode call: unwrapped


def _records(steps: int, layers: int, experts: int) -> list[TraceRecord]:
    """Every call touches all of its layer's experts (a long prompt), two per token."""
    rows = [[e, e + 1] for e in range(0, experts, 2)]
    return [TraceRecord(s, la, [0] * len(rows), rows) for s in range(steps) for la in range(layers)]


def test_streamed_replay_exact_loads_vs_lru_and_belady() -> None:
    # 6 layers x 8 experts, 24 slots (50%): streaming pins layer l while layer l+1 comes in
    recs = _records(6, 6, 8)

    def loads(policy: object, eviction: bool) -> list[int]:
        run = Streaming(0.9, 8, range(6), eviction=eviction)
        r = simulate(recs, 24, policy, streaming=run)  # type: ignore[arg-type]
        assert r.streamed == r.prefetches  # no predictor: every prefetch is streaming's
        return [r.step_loads[s] for s in range(6)]

    assert loads(make_policy("lru"), eviction=False) == [48] * 6  # every step reloads all
    step_aware = loads(make_policy("lru"), eviction=True)
    assert step_aware == [48, 32, 40, 32, 40, 32]
    assert loads(make_policy("step-lru"), eviction=False) == step_aware
    # Belady's rule under the same streaming: the step order is it, step for step
    assert loads(BeladyPolicy(recs, 24), eviction=False) == step_aware
    # the demand optimum (no prefetch pinning) bounds every schedule; the floor is 48 - 24
    assert [belady(recs, 24, {s}).misses for s in range(6)] == [48, 24, 24, 32, 32, 32]


def test_belady_policy_makes_beladys_choices_on_demand_loads() -> None:
    rng = random.Random(3)
    recs = [
        TraceRecord(s, la, [0], [sorted(rng.sample(range(6), 2))])
        for s in range(60)
        for la in range(3)
    ]
    for slots in (2, 4, 7):
        got = simulate(recs, slots, BeladyPolicy(recs, slots))
        assert got.requests - got.hits == belady(recs, slots).misses


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> ExpertLayout:
    overrides = {**MICRO_MIXTRAL, "num_hidden_layers": 4}
    path: Path = make_checkpoint(tmp_path_factory.mktemp("step"), "mixtral", **overrides)
    prefixes = {i: [f"model.layers.{i}.block_sparse_moe"] for i in range(4)}
    return ExpertLayout(Checkpoint(path), prefixes, num_experts=4)


def _cache(layout: ExpertLayout, stream_eviction: bool) -> tuple[ExpertCache, list[ExpertKey]]:
    stats = OffloadStats()
    host = HostTier(layout, 0, torch.float32, False, stats, progress=False)
    cache = ExpertCache(host, 12, torch.device("cpu"), stats, stream_eviction=stream_eviction)
    evicted: list[ExpertKey] = []
    vacate = cache.table.vacate

    def spy(slot: int) -> ExpertKey:
        evicted.append(vacate(slot))
        return evicted[-1]

    cache.table.vacate = spy  # type: ignore[method-assign]
    return cache, evicted


@pytest.mark.parametrize("eviction", [False, True])
def test_engine_streaming_matches_the_replay(layout: ExpertLayout, eviction: bool) -> None:
    """The MoE block's sequence per streamed call: `streaming`, fetch, prefetch of the next
    layer, release; 4 layers x 4 experts, 12 slots."""
    cache, evicted = _cache(layout, eviction)
    for _ in range(5):
        for layer in range(4):
            cache.streaming(layer)
            batch = cache.fetch(layer, [0, 1, 2, 3])
            if layer < 3:
                cache.prefetch(layer + 1, range(4))
            cache.release(batch)
            cache.check_integrity()
    recs = _records(5, 4, 4)
    run = Streaming(0.9, 4, range(4), eviction=eviction)
    replayed = simulate(recs, 12, make_policy("lru"), keep_evictions=True, streaming=run)
    s = cache.stats
    assert (s.requests, s.device_hits, s.prefetches_issued) == (
        replayed.requests,
        replayed.hits,
        replayed.prefetches,
    )
    assert [tuple(k) for k in evicted] == replayed.evictions
    assert replayed.loads == (48 if eviction else 80)  # 16 cold, then 8 vs 16 a step


def test_decode_calls_unchanged_by_stream_eviction(layout: ExpertLayout) -> None:
    """Calls never announced as streamed: the same victims, in the same order, either way; and
    after a streamed step the configured policy is back for decode calls."""
    rng = random.Random(5)
    calls = [(la, sorted(rng.sample(range(4), rng.choice((1, 2, 3))))) for _ in range(30)
             for la in range(4)]  # fmt: skip
    runs = []
    for eviction in (False, True):
        cache, evicted = _cache(layout, eviction)
        for layer, experts in calls:
            cache.release(cache.fetch(layer, experts))
        runs.append((evicted, cache.resident(), cache.stats.device_hits))
    assert runs[0] == runs[1]
    cache, evicted = _cache(layout, True)
    base = cache.policy
    for layer in range(4):  # one streamed step
        cache.streaming(layer)
        cache.release(cache.fetch(layer, [0, 1, 2, 3]))
    assert cache.policy is not base
    cache.release(cache.fetch(0, [1]))  # a decode call: the configured policy alone again
    assert cache.policy is base
    order = base.order()
    missing = next(ExpertKey(la, e) for la in range(4) for e in range(4)
                   if ExpertKey(la, e) not in cache.slot_of)  # fmt: skip
    cache.release(cache.fetch(missing.layer, [missing.expert]))  # the base's victim goes
    assert evicted[-1] == order[0] and cache.resident() == base.order()
