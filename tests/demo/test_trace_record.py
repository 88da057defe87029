"""A recorded real-text trace: dense model + fit routers route exactly as the built demo does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetier.bench.replay import load_trace, replay
from moetier.bench.routing import collect_routing_from_model
from moetier.demo.tracing import per_request_routing, record_variant_trace, save_trace, trace_stats
from moetier.demo.variants import DEFAULT_SPEC
from tests.demo.conftest import all_cores

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the ocean at night."]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def recorded(demo_home: Path) -> Any:
    with all_cores():
        return record_variant_trace(DEFAULT_SPEC, PROMPTS, NEW_TOKENS, demo_home, progress=False)


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
