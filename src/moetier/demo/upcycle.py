"""Upcycling a dense Llama-family model into a Mixtral checkpoint whose experts are FFN copies.

Each layer's MLP becomes num_experts identical experts (gate -> w1, up -> w3, down -> w2) plus a
router. Mixtral renormalizes the top-k softmax weights to sum 1, so the MoE block computes
exactly the dense FFN whatever the router picks: the upcycled model generates what the dense
model generates, while its routing is real.
"""

from __future__ import annotations

from typing import Any

import torch

from moetier.demo.shards import Entry

_COPIED_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_dropout",
    "initializer_range",
)
# dense name suffix -> Mixtral expert tensor
_EXPERT_WEIGHTS = (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))


def mixtral_config(dense_config: Any, num_experts: int, top_k: int, dtype: str) -> Any:
    """A transformers MixtralConfig with the dense model's shapes, norms, rope and vocabulary."""
    from transformers import MixtralConfig

    dense = dense_config.to_dict()
    kwargs = {key: dense[key] for key in _COPIED_CONFIG_KEYS if dense.get(key) is not None}
    if getattr(dense_config, "attention_bias", False) or getattr(dense_config, "mlp_bias", False):
        raise ValueError("Mixtral has no attention or MLP biases; this dense model uses them")
    config = MixtralConfig(
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        output_router_logits=False,
        router_jitter_noise=0.0,
        **kwargs,
    )
    config.architectures = ["MixtralForCausalLM"]
    config.dtype = dtype
    return config


def _dense_layer_entries(
    state: dict[str, torch.Tensor], layer: int, router: torch.Tensor, num_experts: int
) -> list[Entry]:
    dense = f"model.layers.{layer}"
    moe = f"{dense}.block_sparse_moe"
    entries: list[Entry] = [
        (name, state[name])
        for name in sorted(state)
        if name.startswith(f"{dense}.") and ".mlp." not in name
    ]
    entries.append((f"{moe}.gate.weight", router))
    for expert in range(num_experts):
        for dense_name, mixtral_name in _EXPERT_WEIGHTS:
            tensor = state[f"{dense}.mlp.{dense_name}.weight"]
            entries.append((f"{moe}.experts.{expert}.{mixtral_name}.weight", tensor))
    return entries


def upcycled_entries(
    dense_state: dict[str, torch.Tensor],
    routers: list[torch.Tensor],
    num_experts: int,
    tie_word_embeddings: bool,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Entry]:
    """(name, tensor) of the Mixtral checkpoint in file order; experts share their source tensor.

    Each dense tensor is cast to dtype once; the returned list only references those.
    """
    state = {name: t.detach().to(dtype).contiguous() for name, t in dense_state.items()}
    entries: list[Entry] = [("model.embed_tokens.weight", state["model.embed_tokens.weight"])]
    for layer, router in enumerate(routers):
        entries += _dense_layer_entries(state, layer, router.to(dtype).contiguous(), num_experts)
    entries.append(("model.norm.weight", state["model.norm.weight"]))
    if not tie_word_embeddings:
        entries.append(("lm_head.weight", state["lm_head.weight"]))
    known = {name for name, _ in entries} | {
        n for n in state if ".mlp." in n or n == "lm_head.weight"
    }
    missing = sorted(set(state) - known)
    if missing:
        raise ValueError(f"dense tensors with no place in the Mixtral checkpoint: {missing[:5]}")
    return entries
