"""/metrics of a live server: engine steps, MoE layer calls, (token, expert) lookups before the
per-step dedup and the distinct experts per call, parsed by prometheus_client, moving exactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer

NEW_FAMILIES = {
    "moetier:engine_steps": {"step"},
    "moetier:moe_layer_calls": {"routing", "step"},
    "moetier:expert_token_lookups": {"routing", "step"},
    "moetier:expert_distinct_lookups": {"routing", "step"},
}


@pytest.fixture(scope="module")
def server(serve: Callable[..., LiveServer]) -> LiveServer:
    # Half the experts in slots: every MoE call routes on the host, so distinct is measured.
    return serve("--max-num-seqs", "4", "--expert-budget", "50%")


@pytest.fixture(scope="module")
def shape(tiny_model: Path) -> tuple[int, int, int]:
    """(top-k, MoE layers, experts per layer) of the tiny Mixtral (every layer is MoE)."""
    cfg = json.loads((tiny_model / "config.json").read_text())
    return (
        int(cfg["num_experts_per_tok"]),
        int(cfg["num_hidden_layers"]),
        int(cfg["num_local_experts"]),
    )


def _families(server: LiveServer) -> dict[str, Any]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _counters(server: LiveServer) -> dict[tuple[str, str, str], float]:
    """(family, routing, step) -> value of the new counters (fresh: /health?check pulls them)."""
    server.health()
    out = {}
    for name in NEW_FAMILIES:
        for s in _families(server)[name].samples:
            if s.name == name + "_total" and s.labels["model_name"] == server.model:
                out[name, s.labels.get("routing", ""), s.labels["step"]] = s.value
    return out


def _complete(server: LiveServer, prompt: list[int], max_tokens: int) -> None:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_new_families_parse_with_labels_and_help(server: LiveServer) -> None:
    server.health()
    fams = _families(server)
    for name, labels in NEW_FAMILIES.items():
        fam = fams[name]
        assert fam.type == "counter" and fam.documentation, name
        for s in fam.samples:
            if s.name.endswith("_total"):
                assert set(s.labels) == {"model_name", *labels}, (name, s.labels)
    assert "not measured" in fams["moetier:moe_layer_calls"].documentation
    assert "routing=host" in fams["moetier:expert_distinct_lookups"].documentation


def test_one_request_moves_counters_exactly(
    server: LiveServer, shape: tuple[int, int, int]
) -> None:
    k, layers, _ = shape
    before = _counters(server)
    _complete(server, [4, 5, 6], max_tokens=5)  # 3 prompt tokens, then 4 decode steps
    after = _counters(server)
    d = {key: after[key] - before.get(key, 0.0) for key in after}
    assert d["moetier:engine_steps", "", "prefill"] == 1
    assert d["moetier:engine_steps", "", "decode"] == 4
    assert d["moetier:moe_layer_calls", "host", "prefill"] == layers
    assert d["moetier:moe_layer_calls", "host", "decode"] == 4 * layers
    assert d["moetier:expert_token_lookups", "host", "prefill"] == 3 * k * layers
    assert d["moetier:expert_token_lookups", "host", "decode"] == 4 * k * layers
    for step in ("prefill", "decode"):
        assert d["moetier:moe_layer_calls", "device", step] == 0
        assert d["moetier:expert_token_lookups", "device", step] == 0
    # One request alone: each decode call asks for its token's k distinct experts, so the
    # distinct count equals the sum over requests; its 3-token prefill can only dedup.
    assert d["moetier:expert_distinct_lookups", "host", "decode"] == 4 * k * layers
    assert layers * k <= d["moetier:expert_distinct_lookups", "host", "prefill"] <= 3 * k * layers


def test_concurrent_requests_count_every_token_once(
    server: LiveServer, shape: tuple[int, int, int]
) -> None:
    k, layers, experts = shape
    before = _counters(server)
    prompts = [[7 + i, 30 + i, 60 + 2 * i] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: _complete(server, p, 16), prompts))
    after = _counters(server)
    d = {key: after[key] - before.get(key, 0.0) for key in after}
    steps = d["moetier:engine_steps", "", "decode"] + d["moetier:engine_steps", "", "prefill"]
    assert (
        d["moetier:moe_layer_calls", "host", "decode"]
        + d["moetier:moe_layer_calls", "host", "prefill"]
        == steps * layers
    )
    pairs = d["moetier:expert_token_lookups", "host", "decode"]
    distinct = d["moetier:expert_distinct_lookups", "host", "decode"]
    total_pairs = pairs + d["moetier:expert_token_lookups", "host", "prefill"]
    assert total_pairs == (4 * 3 + 4 * 15) * k * layers  # every token fed exactly once
    assert 0 < distinct <= pairs
    # never more distinct experts per call than the layer has, however many requests it serves
    assert distinct <= experts * d["moetier:moe_layer_calls", "host", "decode"]


def test_prefetch_counters_match_the_engine(serve: Callable[..., LiveServer]) -> None:
    """With --prefetch on, /metrics exports the engine's prefetch counters, by outcome."""
    server = serve("--max-num-seqs", "2", "--expert-budget", "50%", "--prefetch", "same-index")
    _complete(server, [4, 5, 6], max_tokens=5)
    stats = server.health()  # fresh engine counters, also what /metrics was last given
    fam = _families(server)["moetier:expert_prefetches"]
    got = {
        s.labels["outcome"]: s.value
        for s in fam.samples
        if s.name.endswith("_total") and s.labels["model_name"] == server.model
    }
    want = {o: float(stats[f"prefetches_{o}"]) for o in ("issued", "used", "in_time", "cancelled")}
    assert got == want and want["issued"] > 0, (got, want)
    wasted = _families(server)["moetier:expert_prefetch_wasted_bytes"].samples
    assert [s.value for s in wasted if s.name.endswith("_total")] == [
        float(stats["prefetch_wasted_bytes"])
    ]


def test_memory_split_gauges_of_a_gpu_memory_server(serve: Callable[..., LiveServer]) -> None:
    """--gpu-memory through `moetier serve`: the split's gauges and its reason at start-up."""
    server = serve("--gpu-memory", "1100MiB", "--max-model-len", "128")
    server.health()
    fams = _families(server)

    def value(name: str, **labels: str) -> float:
        (sample,) = [s for s in fams[name].samples if labels.items() <= s.labels.items()]
        return sample.value

    assert value("moetier:gpu_memory_bytes") == 1100 << 20
    slots = value("moetier:expert_device_slots")
    assert value("moetier:memory_split_expert_bytes") == slots * 73728  # every expert, fp32
    blocks, per_token = (
        value("moetier:kv_cache_blocks_total"),
        value("moetier:kv_cache_bytes_per_token"),
    )
    assert value("moetier:memory_split_kv_bytes") == blocks * 16 * per_token
    assert value("moetier:memory_split_info", split_reason="kv_request") == 1.0
