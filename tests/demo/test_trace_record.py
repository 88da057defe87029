"""A recorded real-text trace: dense model + fit routers route exactly as the built demo does,
and its recorded next-layer predictions are the next router on each layer's MoE input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.bench.replay import load_trace, replay
from moetier.bench.routing import collect_routing_from_model
from moetier.demo.tracing import per_request_routing, record_variant_trace, save_trace, trace_stats
from moetier.demo.variants import DEFAULT_SPEC
from tests.demo.conftest import all_cores

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the ocean at night."]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tapped(demo_home: Path) -> tuple[Any, list[torch.Tensor], list[list[torch.Tensor]]]:
    """(the trace recorded with --predictions, the fit routers, per layer the MoE inputs
    [T, D] of every traced call): the routers and inputs are taken by wrapping the router fit,
    whose model then gets hooks that copy each layer's post-attention norm output."""
    from moetier.demo import builder

    fit = builder.fit_demo_routers
    routers: list[torch.Tensor] = []
    inputs: list[list[torch.Tensor]] = []

    def fit_and_tap(model: Any, *args: Any, **kw: Any) -> tuple[list[torch.Tensor], int]:
        fitted, n = fit(model, *args, **kw)
        routers.extend(fitted)
        for layer in model.model.layers:  # after calibration: only the traced forwards
            calls: list[torch.Tensor] = []
            inputs.append(calls)

            def copy(m: Any, a: Any, out: torch.Tensor, calls: list[torch.Tensor] = calls) -> None:
                calls.append(out.detach().reshape(-1, out.shape[-1]).float().clone())

            layer.post_attention_layernorm.register_forward_hook(copy)
        return fitted, n

    with pytest.MonkeyPatch.context() as mp, all_cores():
        mp.setattr(builder, "fit_demo_routers", fit_and_tap)
        trace = record_variant_trace(
            DEFAULT_SPEC, PROMPTS, NEW_TOKENS, demo_home, progress=False, predictions=True
        )
    return trace, routers, inputs


@pytest.fixture(scope="module")
def recorded(tapped: tuple[Any, Any, Any]) -> Any:
    return tapped[0]


def test_predictions_are_the_next_router_on_this_layers_input(
    tapped: tuple[Any, list[torch.Tensor], list[list[torch.Tensor]]],
) -> None:
    """Every line but the last layer's: `predicted` = top-k (best first) of layer l+1's router
    (bfloat16-rounded, float32 softmax) on layer l's MoE input; `experts` = layer l's own."""
    trace, routers, inputs = tapped
    k, last = trace.header.top_k, len(routers) - 1
    assert trace.version == 2 and len(routers) == 30
    seen = [0] * len(routers)
    for rec in trace.records:
        x = inputs[rec.layer][seen[rec.layer]]  # [T, D]
        seen[rec.layer] += 1

        def top(w: torch.Tensor, x: torch.Tensor = x) -> list[list[int]]:
            logits = torch.nn.functional.linear(x, w.to(torch.bfloat16).float())  # [T, E]
            probs = torch.softmax(logits, dim=-1)
            ids: list[list[int]] = probs.topk(k, dim=-1).indices.tolist()
            return ids

        assert rec.experts == top(routers[rec.layer])
        if rec.layer == last:
            assert rec.predicted is None  # no next MoE layer in the step
        else:
            assert rec.predicted == top(routers[rec.layer + 1])
    assert seen == [len(calls) for calls in inputs] and seen[0] > 2


def test_trace_equals_the_built_demo_routing(
    recorded: Any, moe_model: Any, demo_tokenizer: Any, cores: None
) -> None:
    """Routing the dense hidden states through the fit routers = the 16x2 checkpoint's routing."""
    reference = collect_routing_from_model(moe_model, demo_tokenizer, PROMPTS, NEW_TOKENS)
    assert per_request_routing(recorded) == reference


def test_trace_shape_and_round_trip(recorded: Any, tmp_path: Path) -> None:
    h = recorded.header
    assert (h.num_layers, h.num_experts, h.top_k, h.moe_layers) == (30, 16, 2, list(range(30)))
    assert h.expert_bytes == 3 * 576 * 1536 * 2
    stats = trace_stats(recorded)
    steps = recorded.steps()
    # per prompt: one prefill step, then NEW_TOKENS - 1 decode steps (EOS may end one sooner)
    assert stats.prompts == 2 and steps == list(range(len(steps)))
    assert len(steps) <= 2 * NEW_TOKENS and stats.decode_tokens == len(steps) - 2
    assert stats.lines == 30 * len(steps) + 1
    first = recorded.records[0]
    assert (first.step, first.layer) == (0, 0) and 1 < len(first.experts) < stats.prefill_tokens
    assert first.requests == [0] * len(first.experts)
    for path in (tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"):
        back = load_trace(save_trace(recorded, path))
        assert back.header == h and back.records == recorded.records
    slots, best, rates = replay(recorded, "25%", ["lru"])
    assert slots == 120 and 0 < rates["lru"] <= best <= 1
