"""Registry of model families keyed by HF architecture string.

A family says how to build the module tree and where its routed experts lie in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetier.errors import UnsupportedModelError
from moetier.models.base import CausalLM


@dataclass(frozen=True)
class Family:
    """How to build one family: the module tree and the checkpoint prefixes of routed experts."""

    name: str
    build: Callable[[Any], CausalLM]
    # config -> {MoE layer index: candidate module prefixes holding `.experts`}
    expert_prefixes: Callable[[Any], dict[int, list[str]]]
    # (our substring, checkpoint substring) tried when a tensor is not found under our name
    name_aliases: tuple[tuple[str, str], ...] = ()
    # Fills, in place, the config names the engine reads where the family's config spells
    # them otherwise (Gemma 4's top_k_experts as num_experts_per_tok); run by get_family.
    adapt_config: Callable[[Any], None] | None = None
    # Fused gate_up tensors alternate gate and up rows (gpt-oss); weights/experts.py
    # de-interleaves them while packing.
    gate_up_interleaved: bool = False
    # Why the family's forward cannot be captured as a CUDA graph (a layer reads host values
    # that a graph would fix), or None; the model runner then keeps graphs off.
    no_graphs: str | None = None


FAMILIES: dict[str, Family] = {}


def register(*architectures: str) -> Callable[[Family], Family]:
    def add(family: Family) -> Family:
        for arch in architectures:
            FAMILIES[arch] = family
        return family

    return add


def _load_builtin() -> None:
    # Importing a family module registers it.
    from moetier.models import (  # noqa: F401
        deepseek,
        deepseek_v4,
        gemma4,
        glm4_moe,
        gpt_oss,
        llama4,
        mixtral,
        olmoe,
        qwen2_moe,
        qwen3_5_moe,
        qwen3_moe,
        qwen3_next,
    )


def supported_architectures() -> list[str]:
    _load_builtin()
    return sorted(FAMILIES)


def get_family(config: Any) -> Family:
    _load_builtin()
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in FAMILIES:
            family = FAMILIES[arch]
            if family.adapt_config is not None:
                family.adapt_config(config)
            return family
    raise UnsupportedModelError(
        f"architecture {archs or [getattr(config, 'model_type', '?')]} is not supported; moetier "
        f"supports: {', '.join(supported_architectures())}"
    )
