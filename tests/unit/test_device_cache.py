"""offload/device_cache.py: residency and LRU resolved with tensor ops (here on the CPU), exact
slots and eviction order; kernels/slot_fill.py's Triton kernel equals indexing (interpreter)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moetier.offload import device_cache
from moetier.offload.device_cache import DeviceCache
from moetier.offload.stats import OffloadStats
from tests.unit.test_expert_ffn import _run_in_interpreter

L, E, S, ROW = 2, 4, 4, 3


def _cache(policy: str = "lru") -> DeviceCache:
    host = torch.arange(L * E, dtype=torch.float32)[:, None].repeat(1, ROW) + 1  # row k = k + 1
    host_row = torch.arange(L * E).view(L, E)
    return DeviceCache(torch.zeros(S, ROW), host, host_row, E, 12, policy)


def _resolve(cache: DeviceCache, layer: int, ids: list[list[int]]) -> list[list[int]]:
    return cache.resolve(layer, torch.tensor(ids)).tolist()


def test_lru_slots_and_eviction_order() -> None:
    cache = _cache()
    assert _resolve(cache, 0, [[0, 1]]) == [[0, 1]]  # misses take empty slots, ascending
    assert _resolve(cache, 1, [[2, 3], [3, 2]]) == [[2, 3], [3, 2]]  # keys 6, 7
    # key 1 hits (slot 1, protected); key 3 misses: slots 0 and 1 are least recent (call 1),
    # ties by slot id -> slot 0, evicting key 0
    assert _resolve(cache, 0, [[1, 3]]) == [[1, 0]]
    assert cache.resident() == {3: 0, 1: 1, 6: 2, 7: 3}
    # keys 6, 7 hit; 4, 5 miss into slots 0 then 1 (both last used by call 3), evicting 3, 1
    assert _resolve(cache, 1, [[0, 1, 2, 3]]) == [[0, 1, 2, 3]]
    assert cache.resident() == {4: 0, 5: 1, 6: 2, 7: 3}
    for key, slot in cache.resident().items():
        assert torch.equal(cache.pool[slot], torch.full((ROW,), key + 1.0))
    cache.check_integrity()
    stats = OffloadStats()
    cache.drain(stats)
    assert (stats.requests, stats.device_hits, stats.host_hits, stats.evictions) == (10, 3, 7, 3)
    assert stats.bytes_host_to_device == 7 * 12
    cache.drain(stats)  # counters were reset
    assert stats.requests == 10


@pytest.mark.parametrize(("policy", "third"), [("lru", 1), ("layer-lru", 0)])
def test_layer_quota_evicts_the_layer_over_its_quota(policy: str, third: int) -> None:
    cache = _cache(policy)  # 4 slots, 2 layers: a quota of 2 each
    assert _resolve(cache, 0, [[0, 1, 2]]) == [[0, 1, 2]]
    # the empty slot first, then the least recent: slot 0 (layer 0, over its quota by one)
    assert _resolve(cache, 1, [[0, 1]]) == [[3, 0]]  # keys 4, 5
    # key 6: LRU takes layer 0's least recent slot (1); the quota takes layer 1's own least
    # recent (slot 0), layer 1 being over its quota with this miss and layer 0 at it
    assert _resolve(cache, 1, [[2]]) == [[third]]
    evicted = 1 if policy == "lru" else 5
    assert evicted not in cache.resident() and len(cache.resident()) == 4
    cache.check_integrity()


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown device cache policy 'mru'"):
        _cache("mru")


def test_pool_smaller_than_a_layer_is_refused() -> None:
    with pytest.raises(ValueError, match="4 experts to fit the pool \\(3 slots\\)"):
        DeviceCache(torch.zeros(3, ROW), torch.zeros(L * E, ROW), torch.zeros(L, E), E, 12)


class _GraphUnsafe(TorchDispatchMode):
    """Fails an op that a CUDA graph capture of `resolve` would refuse, seen on meta tensors
    (no data): a host tensor argument; an index_put_ of a 0-dim value (`t[idx] = scalar`, whose
    scalar CUDA stages on the host and copies). Meta tensors also fail every op that needs the
    data on the host (bincount's size, .item(), nonzero)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.device.type == "cpu":
                raise AssertionError(f"{func} takes a host tensor {tuple(a.shape)}")
        if func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            assert args[2].dim() > 0, f"{func} of a scalar: staged on the host on CUDA"
        return func(*args, **kwargs)


@pytest.mark.parametrize("policy", ["lru", "layer-lru"])
def test_resolve_is_capturable(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve's ops on meta tensors: nothing reads data on the host or stages a scalar there
    (on the H100 `need[ids] = True` and bincount made every decode-graph capture fail)."""
    cache = _cache(policy)
    for name in ("pool", "host_pool", "host_row", "slot_of", "key_of", "last_use", "clock"):
        setattr(cache, name, getattr(cache, name).to("meta"))
    cache.counters, cache._arange_e = cache.counters.to("meta"), cache._arange_e.to("meta")
    fills: list[tuple[torch.Tensor, torch.Tensor]] = []
    monkeypatch.setattr(device_cache, "fill_slots", lambda h, p, src, dst: fills.append((src, dst)))
    ids = torch.tensor([[0, 1], [3, 1]]).to("meta")
    with _GraphUnsafe():
        slots = cache.resolve(1, ids)
    assert slots.shape == (2, 2) and slots.dtype == torch.int32 and len(fills) == 1


_FILL = """
import torch
from moetier.kernels.slot_fill import fill_slots
g = torch.Generator().manual_seed(0)
for dtype, row in ((torch.bfloat16, 40), (torch.uint8, 96), (torch.float32, 7)):
    host = (torch.randn(6, row, generator=g) * 50).to(dtype)
    pool = torch.zeros(5, row, dtype=dtype)
    want = pool.clone()
    src = torch.tensor([-1, 4, 0, -1, 2])
    dst = torch.tensor([-1, 3, 0, -1, 1])
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0:
            want[d] = host[s]
    fill_slots(host, pool, src, dst)
    assert torch.equal(pool, want), dtype
print("ok")
"""


def test_fill_kernel_in_interpreter() -> None:
    pytest.importorskip("triton")
    _run_in_interpreter(_FILL)


def test_route_log_holds_each_call_until_taken() -> None:
    cache = _cache()
    assert not cache.log_routes(0, torch.tensor([[0, 1]]))  # closed: the caller tells at once
    cache.open_route_log(4)
    assert cache.log_routes(0, torch.tensor([[1, 0], [2, 3]]))
    assert cache.log_routes(1, torch.tensor([[3, 2]]))
    assert not cache.log_routes(1, torch.tensor([[0, 1, 2], [1, 2, 3]]))  # 6 pairs > 4
    mark = cache.mark()
    cache.log_routes(0, torch.tensor([[0, 3]]))  # a capture's forward: rewound, then replayed
    captured = cache.rewind(mark)
    assert captured == [(2, 0, 2, 2)]  # row 2: the step's earlier calls keep theirs
    assert cache.take_routes() == [(0, [1, 0, 2, 3], 2), (1, [3, 2], 2)]
    assert cache.take_routes() == []
    assert cache.route_log is not None
    cache.route_log[2, :2] = torch.tensor([2, 1])  # what a replay's captured copy writes
    cache.replayed(captured)
    assert cache.take_routes() == [(0, [2, 1], 2)]
    for layer in (0, 1, 0, 1):  # 2 x L rows: a capture's warm-up and captured forwards
        assert cache.log_routes(layer, torch.tensor([[0, 1]]))
    assert not cache.log_routes(0, torch.tensor([[0, 1]]))
