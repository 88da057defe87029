"""Gemma 4 MoE text (Gemma4ForCausalLM with enable_moe_block, e.g. Gemma-4-26B-A4B): every
layer runs a dense GeGLU MLP *beside* 128-way routed experts, each branch with its own pre and
post norms; sliding-window and full attention layers of different geometry
(layers/gemma4_attention.py); the router of layers/gemma4_router.py; embeddings scaled by
sqrt(hidden), a learned per-layer output scalar, tied LM head with final logit soft-capping.
Routed experts are stored fused (`layers.{i}.experts.gate_up_proj` [E, 2I, D], `down_proj`
[E, D, I]), read by offset by weights/experts.py.

Per-layer embeddings (Gemma 4 E2B/E4B) and KV sharing across layers are not supported: no
released MoE checkpoint uses them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.kernels.expert_ffn import GELU_TANH
from moetier.layers.context import ForwardContext
from moetier.layers.gemma4_attention import Gemma4Attention
from moetier.layers.gemma4_router import Gemma4Router
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import MoEBlock
from moetier.layers.norm import GemmaRMSNorm
from moetier.models.base import CausalLM
from moetier.models.registry import Family, register

# Legend: T tokens, D hidden.


class Gemma4MoE(MoEBlock):
    """Routed experts that route on one input (the residual) and compute on another.

    The expert kernels compute Gemma 4's gelu_pytorch_tanh experts (kernels/expert_ffn.py
    GELU_TANH: the loop's gelu in float32, rounded, times up; no clamp, no biases; the
    per-expert scale is in the routing weight); another activation takes the per-expert loop
    (`kernel_act` None: the kernel switches read off, MoEBlock).
    """

    def __init__(self, layer: int, gate: nn.Module, act: str) -> None:
        super().__init__(layer, gate, act)
        self.kernel_act = GELU_TANH if act == "gelu_pytorch_tanh" else None

    def forward(self, x: torch.Tensor, experts_in: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] the router input, experts_in [T, D] the experts' input -> [T, D]."""
        experts_in = x if experts_in is None else experts_in
        if not isinstance(self.gate, Gemma4Router):
            # A swapped-in router (the bench's routing override) routes on the experts' input.
            return self.routed(experts_in)
        self.gate.hold(self.gate.route(x))  # [T, K] ids and weights for the call below
        try:
            return self.routed(experts_in)
        finally:
            self.gate.hold(None)


class Gemma4DecoderLayer(nn.Module):
    """HF's Gemma4TextDecoderLayer: attention, then dense MLP + routed experts, then the
    layer scalar. Names equal the checkpoint's (the router is `router`, shared with `moe`)."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        d, eps, act = config.hidden_size, config.rms_norm_eps, config.hidden_activation
        self.self_attn = Gemma4Attention(config, layer)
        self.mlp = GatedMLP(d, config.intermediate_size, act)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)  # the dense MLP's
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(d, eps)  # the experts'
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)  # of the two branches' sum
        # Registered before `moe`, so its parameters are named `router.*` (as on disk) and
        # `moe.gate` is the same module.
        self.router = Gemma4Router(d, config.num_experts, config.top_k_experts, eps)
        self.moe = Gemma4MoE(layer, self.router, act)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # HF's buffer, in the model dtype

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), ctx)
        x = x + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        routed = self.moe(x, self.pre_feedforward_layernorm_2(x))
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return x * self.layer_scalar


class Gemma4CausalLM(CausalLM):
    """Scaled embeddings in, soft-capped logits out."""

    def __init__(self, config: Any, layers: list[nn.Module]) -> None:
        super().__init__(config, layers)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.softcap: float | None = config.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, D]."""
        embed = self.model.embed_tokens
        # HF rounds sqrt(hidden) to the weight dtype first (55.4256 -> 55.5 in bfloat16); a
        # Python scalar of that value multiplies the same, with no host-to-device copy.
        scale = float(torch.tensor(self.embed_scale, dtype=embed.weight.dtype))
        x = embed(input_ids) * scale
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] in float32, soft-capped in the model dtype as HF."""
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def _check(config: Any) -> None:
    unsupported = {
        "enable_moe_block unset (a dense Gemma 4)": not config.enable_moe_block,
        "per-layer embeddings (hidden_size_per_layer_input)": config.hidden_size_per_layer_input,
        "KV sharing (num_kv_shared_layers)": config.num_kv_shared_layers,
        "use_bidirectional_attention='all'": config.use_bidirectional_attention == "all",
    }
    found = [what for what, bad in unsupported.items() if bad]
    if found:
        raise UnsupportedModelError(
            f"Gemma 4 checkpoints with {', '.join(found)} are not supported: moetier runs the "
            "Gemma 4 MoE text model (e.g. Gemma-4-26B-A4B)"
        )


def build(config: Any) -> CausalLM:
    _check(config)
    layers: list[nn.Module] = [
        Gemma4DecoderLayer(config, i) for i in range(config.num_hidden_layers)
    ]
    return Gemma4CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    return {i: [f"model.layers.{i}"] for i in range(config.num_hidden_layers)}


def adapt_config(config: Any) -> None:
    """Refuse what is not supported before the engine reads expert counts; the engine reads
    the top-k as num_experts_per_tok, which Gemma 4 names top_k_experts."""
    _check(config)
    if getattr(config, "num_experts_per_tok", None) is None:
        config.num_experts_per_tok = config.top_k_experts


FAMILY = register("Gemma4ForCausalLM")(Family("gemma4", build, expert_prefixes, (), adapt_config))


def adapt_wrapper(config: Any) -> None:
    """The multimodal checkpoint (Gemma4ForConditionalGeneration, the released form) keeps the
    text model's settings in text_config; those the engine reads from the top level are copied
    there (where the wrapper lacks them). Its vision and audio towers are never loaded."""
    text = config.text_config
    adapt_config(text)
    for name in _ENGINE_READS:
        if getattr(config, name, None) is None:
            setattr(config, name, getattr(text, name))


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


WRAPPER = register("Gemma4ForConditionalGeneration")(
    Family(
        "gemma4",
        lambda config: build(config.text_config),
        lambda config: {i: [f"model.language_model.layers.{i}"] for i in expert_prefixes(config)},
        (("model.", "model.language_model."),),
        adapt_wrapper,
    )
)
