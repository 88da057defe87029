"""The built demo checkpoint: standard Mixtral layout, dense-equal greedy output, sticky routing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from moetier.bench.routing import DEFAULT_PROMPTS, collect_routing_from_model, summarize_routing
from moetier.demo.builder import MAX_SHARD_BYTES, ensure_demo_model, is_complete
from moetier.demo.verify import greedy_ids
from tests.demo.conftest import KNOWN_ANSWERS, MAX_NEW_TOKENS

pytestmark = pytest.mark.slow


def test_config_is_mixtral_16x2(demo_model: Path) -> None:
    config = json.loads((demo_model / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (16, 2)
    assert (config["hidden_size"], config["intermediate_size"]) == (576, 1536)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config


def test_shards_and_index(demo_model: Path) -> None:
    index = json.loads((demo_model / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1
    assert all((demo_model / s).stat().st_size <= MAX_SHARD_BYTES for s in shards)
    assert sum(n.endswith(".w1.weight") for n in weight_map) == 30 * 16
    assert weight_map.keys() >= {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.29.block_sparse_moe.experts.15.w2.weight",
    }
    assert not any(".mlp." in n or n == "lm_head.weight" for n in weight_map)


def test_experts_are_bf16_copies_and_router_is_fitted(demo_model: Path) -> None:
    index = json.loads((demo_model / "model.safetensors.index.json").read_text())
    prefix = "model.layers.7.block_sparse_moe"
    tensors: dict[str, torch.Tensor] = {}
    for name in [f"{prefix}.gate.weight"] + [f"{prefix}.experts.{e}.w3.weight" for e in (0, 9)]:
        with safe_open(str(demo_model / index["weight_map"][name]), "pt") as f:
            tensors[name] = f.get_tensor(name)
    first, other = (
        tensors[f"{prefix}.experts.0.w3.weight"],
        tensors[f"{prefix}.experts.9.w3.weight"],
    )
    assert first.dtype == torch.bfloat16 and first.shape == (1536, 576)
    assert torch.equal(first, other)
    router = tensors[f"{prefix}.gate.weight"].float()
    assert router.shape == (16, 576)
    assert torch.linalg.matrix_rank(router) == 16  # 16 distinct directions, not a copy


def test_cached_build_is_reused(demo_home: Path, demo_model: Path) -> None:
    assert is_complete(demo_model)
    stamp = (demo_model / "config.json").stat().st_mtime_ns
    assert ensure_demo_model(demo_home, progress=False) == demo_model
    assert (demo_model / "config.json").stat().st_mtime_ns == stamp
    assert not list(demo_model.parent.glob(".*.tmp-*"))


def test_dense_reference_knows_the_answers(
    dense_reference: dict[str, list[int]], demo_tokenizer: Any
) -> None:
    for question, answer in KNOWN_ANSWERS:
        assert answer in demo_tokenizer.decode(dense_reference[question]), question


def test_transformers_greedy_equals_dense(
    moe_model: Any,
    demo_tokenizer: Any,
    prompt_ids: dict[str, list[int]],
    dense_reference: dict[str, list[int]],
    cores: None,
) -> None:
    """AutoModelForCausalLM on the checkpoint answers token for token like the dense model.

    Dense = the source GGUF through transformers with weights rounded to bfloat16 (the weights
    the checkpoint stores), computed in float32; the MoE also computes in float32.
    """
    assert type(moe_model).__name__ == "MixtralForCausalLM"
    for question, answer in KNOWN_ANSWERS:
        got = greedy_ids(moe_model, prompt_ids[question], MAX_NEW_TOKENS)
        assert got == dense_reference[question], question
        assert answer in demo_tokenizer.decode(got), question


def test_demo_reuse_beats_random_twice(moe_model: Any, demo_tokenizer: Any, cores: None) -> None:
    trace = collect_routing_from_model(moe_model, demo_tokenizer, DEFAULT_PROMPTS, MAX_NEW_TOKENS)
    summary = summarize_routing(trace, num_experts=16, top_k=2)
    assert len(summary.reuse) == 30
    assert summary.random_reuse == pytest.approx(0.125)
    assert summary.mean_reuse >= 2 * summary.random_reuse
    # the router spreads work: every layer uses most experts over the prompt set
    assert all(sum(c > 0 for c in counts) >= 12 for counts in summary.popularity)
