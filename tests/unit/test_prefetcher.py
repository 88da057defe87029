"""The prefetcher's exact prefetch of hash-routed layers (DeepSeek-V4's first MoE layers), on
hand-made tables and a recording provider: which layer's experts are prefetched when, exactly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moetier.errors import ConfigError
from moetier.offload.predict import HashOnlyPredictor, HashRoutes, make_predictor
from moetier.offload.prefetcher import Prefetcher, build_prefetcher

# vocab 6, top-2: token t of layer 0 -> T0[t], of layer 1 -> T1[t]; layers 2 and 3 learned
T0 = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 0]])
T1 = torch.tensor([[7, 6], [5, 4], [3, 2], [1, 0], [0, 2], [4, 7]])


class Recorder:
    """A provider that records prefetch calls (layer, experts)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []

    def prefetch(self, layer: int, experts: Any) -> int:
        self.calls.append((layer, list(experts)))
        return len(experts)


def _blocks(hashed: tuple[int, ...] = (0, 1)) -> list[Any]:
    def gate(layer: int) -> Any:
        if layer in hashed:
            return SimpleNamespace(needs_token_ids=True, tid2eid=(T0, T1)[layer])
        return SimpleNamespace()  # a learned router

    return [SimpleNamespace(layer=la, gate=gate(la)) for la in range(4)]


def _flat(table: torch.Tensor, ids: list[int]) -> list[int]:
    return table[torch.tensor(ids)].flatten().tolist()  # a call's routed ids, token-major


def test_hash_routes_are_the_tables_rows_distinct_ascending() -> None:
    routes = HashRoutes.from_blocks(_blocks())
    assert routes is not None and sorted(routes.tables) == [0, 1] and routes.top_k == 2
    routes.begin_step([4, 1, 4, 5])  # layer 0: {1,6} {2,3} {1,6} {3,0}; layer 1: {0,2} {5,4} ...
    assert routes.experts(0) == [0, 1, 2, 3, 6]
    assert routes.experts(1) == [0, 2, 4, 5, 7]
    assert routes.experts(2) == []  # learned: nothing known
    assert routes.is_step(8) and not routes.is_step(6)  # 4 tokens x top-2 pairs
    assert HashRoutes.from_blocks(_blocks(hashed=())) is None


def test_exact_prefetch_per_step_with_a_guessing_predictor() -> None:
    provider = Recorder()
    prefetcher = build_prefetcher("last-call", _blocks(), provider)  # type: ignore[arg-type]
    step1, step2 = [2, 5], [3]
    prefetcher.begin_step(step1)
    assert provider.calls == [(0, [0, 3, 4, 5])]  # layer 0 before any layer runs: T0[2], T0[5]
    prefetcher(0, _flat(T0, step1), None)  # -> layer 1: T1[2], T1[5]
    prefetcher(1, _flat(T1, step1), None)  # -> layer 2: last-call has seen no layer-2 call
    prefetcher(2, [1, 2, 1, 3], None)  # -> layer 3: nor a layer-3 call
    prefetcher(3, [5, 6, 6, 7], None)  # -> layer 0 of the next step: never guessed
    assert provider.calls == [(0, [0, 3, 4, 5]), (1, [2, 3, 4, 7])]
    provider.calls.clear()
    prefetcher.begin_step(step2)
    prefetcher(0, _flat(T0, step2), None)
    prefetcher(1, _flat(T1, step2), None)  # -> layer 2: its last call's ids, cut to width 2
    prefetcher(2, [1, 2, 1, 3], None)  # -> layer 3: its last call's, 6 (two tokens) first
    prefetcher(3, [5, 6, 6, 7], None)  # last-call saw layer 0's [6, 7]: still no guess
    assert provider.calls == [(0, [6, 7]), (1, [0, 1]), (2, [1, 2]), (3, [6, 5, 7])]


def test_two_ahead_and_a_call_that_is_not_the_steps() -> None:
    provider = Recorder()
    prefetcher = build_prefetcher("hash", _blocks(), provider, ahead=2)  # type: ignore[arg-type]
    prefetcher.begin_step([0])
    assert provider.calls == [(0, [0, 1]), (1, [6, 7])]  # the first two MoE layers
    prefetcher(0, _flat(T0, [0]), None)  # -> layer 1 again (a resident key is skipped there)
    prefetcher(1, _flat(T1, [0]), None)  # -> layers 2, 3: `hash` guesses nothing
    assert provider.calls[2:] == [(1, [6, 7])]
    prefetcher(0, [0, 1, 2, 3], None)  # 2 tokens' pairs in a 1-token step: not this step's
    assert len(provider.calls) == 3


def test_hash_predictor_needs_hash_layers_and_others_get_no_routes() -> None:
    with pytest.raises(ConfigError, match="has none; pick another predictor"):
        build_prefetcher("hash", _blocks(hashed=()), Recorder())  # type: ignore[arg-type]
    plain = build_prefetcher("last-call", _blocks(hashed=()), Recorder())  # type: ignore[arg-type]
    assert plain.hash_routes is None  # the model runner never calls begin_step for it
    assert isinstance(make_predictor("hash"), HashOnlyPredictor)
    assert make_predictor("hash").needs_token_ids


def test_prefetcher_without_routes_is_unchanged() -> None:
    provider = Recorder()
    prefetcher = Prefetcher(make_predictor("same-index", moe_layers=[0, 1]), provider)  # type: ignore[arg-type]
    prefetcher(0, [3, 1, 3, 2], None)
    assert provider.calls == [(1, [3, 1, 2])]
