"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): every layer MoE, attention with
sinks and biases alternating sliding-window and full layers (layers/gpt_oss_attention.py), yarn
rope, a biased linear router (top-k of the logits, softmax over those k), and experts with
biases and a clamped SwiGLU: (clamp(up, ±7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7).

Experts are stored fused, gate and up interleaved in the 2I dim: bfloat16 as
`mlp.experts.gate_up_proj` [E, D, 2I] + `down_proj` [E, I, D], or MXFP4 (the released
checkpoints, `quantization_config.quant_method: mxfp4`) as `*_blocks` + `*_scales`, read as
stored and decoded per expert where computed (weights/experts.py, weights/mxfp4.py). Their
biases (`gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, D]) are small and stay resident in
the MoE block, where the expert kernels read them by expert id. The kernels compute the
experts (kernels/expert_ffn.py GPT_OSS_SWIGLU, with the biases), bfloat16/float32 or MXFP4
decoded in registers (kernels/slot_layout.py: gate and up de-interleaved into two matrices).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.kernels.expert_ffn import GPT_OSS_SWIGLU, ExpertMath
from moetier.layers.context import ForwardContext
from moetier.layers.gpt_oss_attention import GptOssAttention
from moetier.layers.moe import MoEBlock, moe_config
from moetier.models.base import CausalLM
from moetier.models.registry import Family, register

# Legend: T tokens, E experts, K top-k, D hidden, I expert intermediate, n an expert's rows.

READABLE_QUANT_METHODS = ("mxfp4",)  # besides none: the experts' storage moetier decodes


class GptOssRMSNorm(nn.Module):
    """HF's GptOssRMSNorm: normalized and scaled in float32, then cast back (HF keeps these
    weights in float32; the checkpoints store them in bfloat16, so the values are equal)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GptOssRouter(nn.Module):
    """Linear with bias, top-k of the logits, softmax over the k in the logits' dtype."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, K] int64, weights [T, K] in x's dtype."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, K]
        return ids, F.softmax(top, dim=1, dtype=top.dtype)


class GptOssExpertBiases(nn.Module):
    """The routed experts' biases, named as on disk (`mlp.experts.*`), kept as stored: the
    gate_up bias interleaved (gate = even columns, up = odd)."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))


class GptOssMoE(MoEBlock):
    """Routed experts with biases and the clamped SwiGLU (HF's GptOssExperts): by the expert
    kernels (`expert_math`), or one expert at a time by MoEBlock's loop through `expert_mlp`."""

    def __init__(self, layer: int, config: Any) -> None:
        num_experts, top_k, inter = moe_config(config)
        d = config.hidden_size
        super().__init__(layer, GptOssRouter(d, num_experts, top_k))
        self.experts = GptOssExpertBiases(num_experts, d, inter)
        self.topk_sum = True  # each token's K outputs summed at once, as HF's grouped_mm
        self.alpha = float(config.swiglu_alpha)
        self.limit = float(config.swiglu_limit)
        self.act_name = "clamped_silu"
        self.kernel_act = GPT_OSS_SWIGLU

    def expert_math(self) -> ExpertMath:
        """The kernels' view of `expert_mlp`: its biases as views of the resident ones (gate
        = even columns, up = odd; no copy, so they follow the loaded values)."""
        gate_up = self.experts.gate_up_proj_bias  # [E, 2I] interleaved
        biases = (gate_up[:, 0::2], gate_up[:, 1::2], self.experts.down_proj_bias)
        return ExpertMath(GPT_OSS_SWIGLU, self.limit, self.alpha, biases, self.topk_sum)

    def expert_mlp(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert: int
    ) -> torch.Tensor:
        """x [n, D], gate_up [2I, D] (gate rows, then up rows: de-interleaved when packed),
        down [D, I] -> [n, D]; the products and bias adds in HF's order (matmul, then bias)."""
        bias = self.experts.gate_up_proj_bias[expert]  # [2I] interleaved
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
        g = (g + bias[0::2]).clamp(max=self.limit)
        u = (u + bias[1::2]).clamp(min=-self.limit, max=self.limit)
        glu = g * torch.sigmoid(g * self.alpha)
        return F.linear((u + 1) * glu, down) + self.experts.down_proj_bias[expert]


class GptOssDecoderLayer(nn.Module):
    """Pre-norm residual block (HF's GptOssDecoderLayer), named as in the checkpoint."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GptOssAttention(config, layer)
        self.mlp = GptOssMoE(layer, config)
        self.input_layernorm = GptOssRMSNorm(d, eps)
        self.post_attention_layernorm = GptOssRMSNorm(d, eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def quant_method(config: Any) -> str | None:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    return None if method is None else str(method)


def _check(config: Any) -> None:
    method = quant_method(config)
    if method is not None and method not in READABLE_QUANT_METHODS:
        raise UnsupportedModelError(
            f"gpt-oss checkpoint with quantization_config.quant_method={method!r}: moetier "
            f"reads gpt-oss experts in bfloat16/float16/float32 or MXFP4 ('mxfp4') only; use "
            f"the released MXFP4 checkpoint or a dequantized one"
        )


def build(config: Any) -> CausalLM:
    _check(config)
    layers: list[nn.Module] = [
        GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)
    ]
    model = CausalLM(config, layers)
    model.model.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
    return model


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    return {i: [f"model.layers.{i}.mlp"] for i in range(config.num_hidden_layers)}


FAMILY = register("GptOssForCausalLM")(
    Family(
        "gpt_oss",
        build,
        expert_prefixes,
        ((".mlp.gate.", ".mlp.router."),),
        adapt_config=_check,
        gate_up_interleaved=True,
    )
)
