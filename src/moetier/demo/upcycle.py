"""Upcycling a dense Llama-family model into a Mixtral checkpoint whose experts are FFN copies.

Each layer's MLP becomes num_experts identical experts (gate -> w1, up -> w3, down -> w2) plus a
router. Mixtral renormalizes the top-k softmax weights to sum 1, so the MoE block computes
exactly the dense FFN whatever the router picks: the upcycled model generates what the dense
model generates, while its routing is real.

Perturbed variants (`perturb > 0`) make each expert tensor the dense one plus seeded Gaussian
noise of relative scale `perturb` (noise RMS = perturb x the tensor's RMS), so that computing a
wrong expert changes the output. The noise is made when the shard writer reaches the tensor:
a 128-expert variant never holds more than one expert tensor of noise in RAM.
"""

from __future__ import annotations

from typing import Any

import torch

from moetier.demo.shards import Entry, LazyTensor

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


def noise_seed(seed: int, layer: int, expert: int, tensor: int) -> int:
    """The generator seed of one expert tensor's noise (unique below 4096 layers and experts)."""
    assert 0 <= layer < 4096 and 0 <= expert < 4096 and 0 <= tensor < 4
    return ((seed * 4096 + layer) * 4096 + expert) * 4 + tensor


def perturbed(base: torch.Tensor, scale: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """base + scale * rms(base) * N(0, 1) from torch.Generator(seed), computed in float32."""
    x = base.float()
    rms = x.pow(2).mean().sqrt()
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    return (x + noise.mul_(scale * rms)).to(dtype).contiguous()


def _expert_tensor(
    base: torch.Tensor, perturb: float, seed: int, layer: int, expert: int, tensor: int
) -> torch.Tensor | LazyTensor:
    if perturb <= 0:
        return base
    nseed = noise_seed(seed, layer, expert, tensor)
    return LazyTensor(
        tuple(base.shape), base.dtype, lambda: perturbed(base, perturb, nseed, base.dtype)
    )


def _dense_layer_entries(
    state: dict[str, torch.Tensor],
    layer: int,
    router: torch.Tensor,
    num_experts: int,
    perturb: float = 0.0,
    seed: int = 0,
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
        for t, (dense_name, mixtral_name) in enumerate(_EXPERT_WEIGHTS):
            base = state[f"{dense}.mlp.{dense_name}.weight"]
            tensor = _expert_tensor(base, perturb, seed, layer, expert, t)
            entries.append((f"{moe}.experts.{expert}.{mixtral_name}.weight", tensor))
    return entries


def upcycled_entries(
    dense_state: dict[str, torch.Tensor],
    routers: list[torch.Tensor],
    num_experts: int,
    tie_word_embeddings: bool,
    dtype: torch.dtype = torch.bfloat16,
    perturb: float = 0.0,
    seed: int = 0,
) -> list[Entry]:
    """(name, tensor) of the Mixtral checkpoint in file order; experts share their source tensor.

    Each dense tensor is cast to dtype once; the returned list only references those. With
    perturb > 0 each expert tensor is a LazyTensor: the dense one plus its own seeded noise.
    """
    state = {name: t.detach().to(dtype).contiguous() for name, t in dense_state.items()}
    entries: list[Entry] = [("model.embed_tokens.weight", state["model.embed_tokens.weight"])]
    for layer, router in enumerate(routers):
        router_t = router.to(dtype).contiguous()
        entries += _dense_layer_entries(state, layer, router_t, num_experts, perturb, seed)
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
