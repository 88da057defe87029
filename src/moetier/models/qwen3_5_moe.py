"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, and the language model of the multimodal
Qwen3_5MoeForConditionalGeneration, e.g. Qwen3.5-35B-A3B / Qwen3.6-35B-A3B): Qwen3-Next's
hybrid layers (models/qwen3_next.py) with the Gated DeltaNet's projections split (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a), every layer MoE, top-k weights always renormalized. Routed
experts are fused on disk (`mlp.experts.gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]), read
by offset by weights/experts.py.

Text positions only: the multimodal rope (mrope, sections over time/height/width) rotates every
channel by the same text position, which is plain rope on the rotated share (partial rotary).
The vision tower of the wrapper is never loaded.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moetier.layers.moe import moe_config
from moetier.models.base import CausalLM
from moetier.models.qwen3_next import (
    HybridCausalLM,
    HybridDecoderLayer,
    layer_types,
    mixer,
    shared_moe,
)
from moetier.models.registry import Family, register


def build(config: Any) -> CausalLM:
    types = layer_types(config)
    layers: list[nn.Module] = [
        HybridDecoderLayer(config, i, mixer(config, i, kind, True), shared_moe(config, i, True))
        for i, kind in enumerate(types)
    ]
    return HybridCausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    assert moe_config(config)[0] > 0, "Qwen3.5-MoE config names no experts"
    return {i: [f"model.layers.{i}.mlp"] for i in range(config.num_hidden_layers)}


def _text_or_wrapped(config: Any) -> dict[int, list[str]]:
    """A text-only config over tensors saved by the multimodal wrapper (`model.language_model.`,
    as transformers itself loads them) is found too."""
    return {
        i: [p, p.replace("model.", "model.language_model.", 1)]
        for i, (p,) in expert_prefixes(config).items()
    }


_WRAPPED = (("model.", "model.language_model."),)

FAMILY = register("Qwen3_5MoeForCausalLM")(Family("qwen3_5_moe", build, _text_or_wrapped, _WRAPPED))


# Top-level config names the engine, loader and bench read (layers/moe.py moe_config, the
# engine's vocabulary and stop tokens, the runner's default max_model_len).
_ENGINE_READS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
    "eos_token_id",
)


def adapt_wrapper(config: Any) -> None:
    """The multimodal checkpoint keeps the text model's settings in text_config; those the
    engine reads from the top level are copied there (where the wrapper lacks them)."""
    text = config.text_config
    for name in _ENGINE_READS:
        if getattr(config, name, None) is None:
            setattr(config, name, getattr(text, name, None))


WRAPPER = register("Qwen3_5MoeForConditionalGeneration")(
    Family(
        "qwen3_5_moe",
        lambda config: build(config.text_config),
        lambda config: {
            i: [f"model.language_model.layers.{i}.mlp"] for i in expert_prefixes(config.text_config)
        },
        _WRAPPED,
        adapt_wrapper,
    )
)
