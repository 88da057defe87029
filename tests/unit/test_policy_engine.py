"""The engine's expert cache gives the slot policy each token's request id and routing with a
layer call's first wave, and each finished request: checked against the routing the MoE layers
report to an observer and the batches the scheduler makes, id for id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetier import LLM, SamplingParams
from moetier.offload.activation import ActivationPolicy
from moetier.offload.policy import LFRUPolicy
from tests.models.families import FAMILIES
from tests.models.parity import min_budget

# request id -> (prompt, tokens to generate); 70 finishes first, 71 runs alone afterwards
REQUESTS = {70: ([5, 9, 17, 33, 2], 2), 71: ([40, 41, 42, 43, 44, 45, 46, 47, 48], 5)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["mixtral"].checkpoint(tmp_path_factory.mktemp("mixtral"), seed=5)


def _llm(path: Path, policy: str, slot_kernel: bool = False) -> LLM:
    """Top-k slots: the prefill's calls and some decode calls need several waves. With the
    slot kernel (forced on the CPU) half the experts: every call fits one `slot_wave`."""
    return LLM(
        str(path),
        expert_budget="50%" if slot_kernel else min_budget(path),
        policy=policy,
        device="cpu",
        dtype="float32",
        progress=False,
        moe_slot_kernel_max_pairs=1 << 20 if slot_kernel else None,
    )


class _Spy:
    """Records what the policy is told, what the MoE layers route and what each step holds."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        self.policy = engine.runner.expert_cache.policy
        self.calls: list[tuple[int, list[int], Any, Any]] = []  # begin_call arguments
        self.routed: list[tuple[int, list[list[int]], list[int]]] = []  # layer, rows, requests
        self.ended: list[int] = []
        self.step_requests: list[int] = []
        begin, end = self.policy.begin_call, self.policy.end_request

        def begin_call(layer: int, experts: Any, requests: Any = None, routing: Any = None) -> None:
            copy = lambda x: None if x is None else [list(r) for r in x]  # noqa: E731
            reqs = None if requests is None else list(requests)
            self.calls.append((layer, list(experts), reqs, copy(routing)))
            begin(layer, experts, requests, routing)

        def end_request(request_id: int) -> None:
            self.ended.append(request_id)
            end(request_id)

        def observe(layer: int, flat: list[int], k: int) -> None:
            rows = [flat[i : i + k] for i in range(0, len(flat), k)]
            self.routed.append((layer, rows, list(self.step_requests)))

        schedule = engine.scheduler.schedule

        def scheduled() -> Any:
            out = schedule()
            self.step_requests = [
                s.request.request_id for s in out.scheduled for _ in range(s.num_new_tokens)
            ]
            return out

        self.policy.begin_call = begin_call  # type: ignore[method-assign]
        self.policy.end_request = end_request  # type: ignore[method-assign]
        engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
        for block in engine.runner.model.moe_blocks():
            block.route_observer = observe


def _generate(llm: LLM) -> dict[int, list[int]]:
    engine = llm.engine
    reqs = [
        engine.add_request(
            prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), request_id=rid
        )
        for rid, (prompt, n) in REQUESTS.items()
    ]
    while engine.has_unfinished():
        engine.step()
    return {r.request_id: list(r.output_token_ids) for r in reqs}


@pytest.mark.parametrize("slot_kernel", [False, True], ids=["waves", "slot-wave"])
def test_activation_policy_sees_each_tokens_request_and_routing(
    ckpt: Path, slot_kernel: bool
) -> None:
    llm = _llm(ckpt, "activation", slot_kernel)
    assert not llm.engine.runner.expert_cache.policy.tracker.retire_absent  # type: ignore[attr-defined]
    spy = _Spy(llm)
    _generate(llm)
    # steps: both prefills, one decode of both, then 71 alone for its last 3 tokens
    first = [70] * 5 + [71] * 9
    layers = len(llm.engine.runner.model.moe_blocks())
    assert [r for _, _, r in spy.routed[::layers]] == [first, [70, 71], [71], [71], [71]]
    # one begin_call with routing per layer call, in order, with the exact ids and requests
    firsts = [c for c in spy.calls if c[3] is not None]
    routed = spy.routed
    if slot_kernel:  # the slot path hands each token's ids over ascending
        routed = [(la, [sorted(row) for row in rows], reqs) for la, rows, reqs in routed]
    assert [(la, routing, reqs) for la, _, reqs, routing in firsts] == routed
    # the other waves of a call come right after its first, with nothing but their experts
    waves: list[tuple[int, set[int]]] = []  # (layer, experts) of each layer call
    for layer, experts, reqs, routing in spy.calls:
        if routing is None:
            assert reqs is None and waves[-1][0] == layer
            waves[-1][1].update(experts)
        else:
            waves.append((layer, set(experts)))
    if slot_kernel:
        assert len(spy.calls) == len(firsts)
    else:
        assert len(spy.calls) > len(firsts), "no layer call needed a second wave"
    assert waves == [(la, {e for row in rows for e in row}) for la, rows, _ in spy.routed]
    # each finished request is told once, in finishing order, and joins the library as its
    # own per-layer use frequencies
    assert spy.ended == [70, 71]
    tracker = spy.policy.tracker
    assert tracker.active == [] and tracker.library_size == 2
    for i, rid in enumerate(spy.ended):
        counts = np.zeros_like(tracker._lib_freq[i])
        tokens = np.zeros(counts.shape[0])
        for layer, rows, reqs in spy.routed:
            for row, r in zip(rows, reqs):
                if r == rid:
                    np.add.at(counts[layer], row, 1.0)
                    tokens[layer] += 1
        assert tokens.sum() == layers * (len(REQUESTS[rid][0]) + REQUESTS[rid][1] - 1)
        np.testing.assert_allclose(tracker._lib_freq[i], counts / np.maximum(tokens, 1)[:, None])


def test_policies_without_routing_get_none_and_keep_the_same_tokens(ckpt: Path) -> None:
    """A policy that does not want routing gets no lists built for it; the tokens do not depend
    on the policy (the slots only change where an expert's weights are read from)."""
    outs = {}
    for name in ("lfru", "activation"):
        llm = _llm(ckpt, name)
        policy = llm.engine.runner.expert_cache.policy
        assert isinstance(policy, ActivationPolicy if name == "activation" else LFRUPolicy)
        spy = _Spy(llm)
        outs[name] = _generate(llm)
        with_routing = [c for c in spy.calls if c[3] is not None or c[2] is not None]
        assert bool(with_routing) == (name == "activation")
        assert spy.ended == [70, 71]
        assert llm.engine.runner.expert_cache.token_requests == (None if name == "lfru" else [71])
        llm.engine.check_integrity()
    assert outs["lfru"] == outs["activation"]


def test_cache_drops_request_ids_that_are_not_the_calls_tokens(ckpt: Path) -> None:
    llm = _llm(ckpt, "activation")
    cache = llm.engine.runner.expert_cache
    spy = _Spy(llm)
    layer = llm.engine.runner.model.moe_blocks()[0].layer
    cache.token_requests = [3, 4, 5]
    cache.release(cache.fetch(layer, [0, 1], [[0, 1], [1, 0]]))  # two tokens, not three
    cache.token_requests = [3, 4]
    cache.release(cache.fetch(layer, [1, 2], [[1, 2], [2, 1]]))
    assert [c[2] for c in spy.calls] == [None, [3, 4]]


def test_activation_predictor_learns_each_finished_request(ckpt: Path) -> None:
    """With `prefetch="activation"` the predictor's tracker is told when a request ends too:
    both requests join its library and none stays active."""
    llm = LLM(
        str(ckpt),
        expert_budget=min_budget(ckpt),
        prefetch="activation",
        device="cpu",
        dtype="float32",
        progress=False,
    )
    prefetcher = llm.engine.runner.prefetcher
    assert prefetcher is not None
    ended: list[int] = []
    end = prefetcher.predictor.end_request

    def spy(request_id: int) -> None:
        ended.append(request_id)
        end(request_id)

    prefetcher.predictor.end_request = spy  # type: ignore[method-assign]
    _generate(llm)
    tracker = prefetcher.predictor.tracker  # type: ignore[attr-defined]
    assert not tracker.retire_absent  # the engine reports every end itself
    assert ended == [70, 71]
    assert tracker.active == [] and tracker.library_size == 2
    llm.engine.check_integrity()
