"""Tiny Qwen3.5-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) GGUF files, written as llama.cpp's
converter writes them (value heads tiled for ggml, in_proj_qkvz split, norms stored as w + 1,
ssm_a = -exp(A_log), the MTP block appended on request), from tiny random HF models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM

from tests.models.families import FAMILIES
from tests.models.gguf_files import write_tokenizer
from tests.models.parity import randomize

# Qwen3.5-MoE / Qwen3-Next: the tiny cross-family recipes (layer types as `full_attention_interval`
# states them, which is what llama.cpp reads), widened where Q8_0 experts need rows of whole
# 32-value blocks (D 64, I 32); grouped value heads (4 over 2 key heads), dk 8 != dv 12.
# Qwen3.5: head_dim 32 so that a quarter rotary (8 dims) has three non-empty mrope sections, as
# the released models do (transformers' GGUF config drops empty ones, then its rotary fails).
HYBRID_ARCH = {"qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
HYBRID_TINY: dict[str, dict[str, Any]] = {
    "qwen3_5_moe": {
        **FAMILIES["qwen3_5_moe"].tiny,
        **FAMILIES["qwen3_5_moe"].main,
        "full_attention_interval": 3,  # linear, linear, full, linear: main's layer_types
        "hidden_size": 64,
        "head_dim": 32,
        "rope_parameters": {
            **FAMILIES["qwen3_5_moe"].main["rope_parameters"],
            "mrope_section": [2, 1, 1],
        },
        "moe_intermediate_size": 32,
    },
    "qwen3_next": {
        **FAMILIES["qwen3_next"].tiny,
        **FAMILIES["qwen3_next"].fused,  # every layer MoE: llama.cpp's qwen3next has no dense
        "norm_topk_prob": True,  # llama.cpp renormalizes the top-k weights, whatever the config
        "hidden_size": 64,
        "moe_intermediate_size": 32,
    },
}
HYBRID_KEYS = (  # what the converter writes (by key suffix; feed_forward_length where stated)
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_sections",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "expert_count",
    "expert_used_count",
    "attention.key_length",
    "attention.value_length",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "full_attention_interval",
    "rope.dimension_count",
    "nextn_predict_layers",
)


def tiny_hybrid_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    config = AutoConfig.for_model(
        FAMILIES[family].model_type, **{**HYBRID_TINY[family], **overrides}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def _hybrid_metadata(w: gguf.GGUFWriter, hp: dict[str, Any], skip: str | None, mtp: int) -> None:
    """TextModel.set_gguf_parameters, Qwen2MoeModel's, Qwen3NextModel's and, for Qwen3.5, the
    mrope and MTP mixins', over the config as saved (`hp`, config.json's dict)."""
    rope = hp.get("rope_parameters") or {}
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    values: dict[str, tuple[Any, Any]] = {
        "block_count": (w.add_block_count, hp["num_hidden_layers"] + mtp),
        "context_length": (w.add_context_length, hp["max_position_embeddings"]),
        "embedding_length": (w.add_embedding_length, hp["hidden_size"]),
        "feed_forward_length": (w.add_feed_forward_length, hp.get("intermediate_size")),
        "attention.head_count": (w.add_head_count, hp["num_attention_heads"]),
        "attention.head_count_kv": (w.add_head_count_kv, hp["num_key_value_heads"]),
        "rope.freq_base": (w.add_rope_freq_base, rope.get("rope_theta")),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, hp["rms_norm_eps"]),
        "expert_count": (w.add_expert_count, hp["num_experts"]),
        "expert_used_count": (w.add_expert_used_count, hp["num_experts_per_tok"]),
        "attention.key_length": (w.add_key_length, hp.get("head_dim")),
        "attention.value_length": (w.add_value_length, hp.get("head_dim")),
        "expert_feed_forward_length": (
            w.add_expert_feed_forward_length,
            hp["moe_intermediate_size"],
        ),
        "expert_shared_feed_forward_length": (
            w.add_expert_shared_feed_forward_length,
            hp["shared_expert_intermediate_size"],
        ),
        "ssm.conv_kernel": (w.add_ssm_conv_kernel, hp["linear_conv_kernel_dim"]),
        "ssm.state_size": (w.add_ssm_state_size, hp["linear_key_head_dim"]),
        "ssm.group_count": (w.add_ssm_group_count, hp["linear_num_key_heads"]),
        "ssm.time_step_rank": (w.add_ssm_time_step_rank, hp["linear_num_value_heads"]),
        "ssm.inner_size": (
            w.add_ssm_inner_size,
            hp["linear_value_head_dim"] * hp["linear_num_value_heads"],
        ),
        "full_attention_interval": (
            w.add_full_attention_interval,
            hp.get("full_attention_interval", 4),
        ),
        # the converter reads the factor from the top level only (0.25 where it is not there)
        "rope.dimension_count": (
            w.add_rope_dimension_count,
            int(head_dim * hp.get("partial_rotary_factor", 0.25)),
        ),
    }
    if hp["model_type"] == "qwen3_5_moe_text":
        # padded to four; _Qwen35MRopeMixin writes [11, 11, 10, 0] where the config has none
        sections = list(rope.get("mrope_section", [11, 11, 10]))
        values["rope.dimension_sections"] = (
            w.add_rope_dimension_sections,
            (sections + [0, 0, 0, 0])[:4],
        )
        if mtp:
            values["nextn_predict_layers"] = (w.add_nextn_predict_layers, mtp)
    for key in HYBRID_KEYS:
        if key in values and key != skip and values[key][1] is not None:
            add, value = values[key]
            add(value)


def _tiled(t: torch.Tensor, dim: int, hk: int, r: int, width: int) -> torch.Tensor:
    """`_LinearAttentionVReorderBase._reorder_v_heads`: grouped [Hk, r, w] -> tiled [r, Hk, w]."""
    shape = list(t.shape)
    return (
        t.reshape(*shape[:dim], hk, r, width, *shape[dim + 1 :])
        .transpose(dim, dim + 1)
        .reshape(shape)
    )


def _converted(name: str, t: torch.Tensor, hp: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """One HF tensor as llama.cpp's converter turns it into GGUF tensors (HF-side names, before
    the name map): Qwen3.5's value-head reorder, then Qwen3NextModel.modify_tensors."""
    hk, hv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    qk = 2 * hk * dk
    if hp["model_type"] == "qwen3_5_moe_text" and hk != hv and "linear_attn." in name:
        r = hv // hk
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, hk, r, dv)])
        elif ".in_proj_z." in name:
            t = _tiled(t, 0, hk, r, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _tiled(t, 0, hk, r, 1)
        elif ".A_log" in name or ".dt_bias" in name:
            t = _tiled(t.unsqueeze(-1), 0, hk, r, 1).squeeze(-1)
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, hk, r, dv)])
        elif ".out_proj." in name:
            t = _tiled(t, 1, hk, r, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name:  # [q, k, v, z] per key head -> all q, k, v; all z
        r = hv // hk
        per_head = t.T.reshape(hp["hidden_size"], hk, -1)
        q, k, v, z = per_head.split([dk, dk, r * dv, r * dv], dim=-1)
        flat = [x.reshape(hp["hidden_size"], -1) for x in (q, k, v, z)]
        base = name.rpartition(".linear_attn.")[0] + ".linear_attn"
        return [
            (f"{base}.in_proj_qkv.weight", torch.cat(flat[:3], dim=-1).T.contiguous()),
            (f"{base}.in_proj_z.weight", flat[3].T.contiguous()),
        ]
    if name.endswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel: gate rows first, then up
        inter = t.shape[-2] // 2
        base = name.removesuffix(".gate_up_proj")
        return [
            (f"{base}.gate_proj.weight", t[:, :inter]),
            (f"{base}.up_proj.weight", t[:, inter:]),
        ]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"{name}.weight", t)]
    return [(name, t)]


def write_hybrid_gguf(
    model: Any,
    path: Path,
    experts: T = T.Q8_0,
    tokenizer: Any = None,
    chat_template: str | None = None,
    skip: str | None = None,
    mtp: bool = False,
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF Qwen3.5-MoE text model or Qwen3-Next) as llama.cpp's converter
    writes it (Qwen3_5MoeTextModel / Qwen3NextModel), experts quantized to `experts` (as
    llama-quantize leaves the rest: 1-D tensors and norms F32; here every non-expert F32);
    metadata key `skip` left out; with `mtp`, an MTP block appended as the newest converter
    writes Qwen3.5's (`blk.{layers}`, `nextn_predict_layers`: a copy of the last layer's
    attention and MoE with the `nextn.*` tensors). Return the reference state dict: the
    model's weights with the experts as gguf dequantizes the bytes written."""
    cfg = model.config
    hp = cfg.to_dict()
    arch = HYBRID_ARCH[cfg.model_type]
    layers = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(_ARCH_ENUMS[arch], layers + int(mtp))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.model_type}")
    _hybrid_metadata(w, hp, skip, int(mtp))
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, chat_template, "qwen35" if arch == "qwen35moe" else "qwen2")
    ref: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    if mtp:  # the draft block (HF `mtp.layers.0.*`, remapped by the converter to blk.{layers})
        last = cfg.layer_types.index("full_attention")
        for name, t in list(state.items()):
            if name.startswith(f"model.layers.{last}."):
                state[name.replace(f".{last}.", f".{layers}.", 1)] = t
    for hf_name, tensor in state.items():
        value = tensor.detach().float()
        if not hf_name.startswith(f"model.layers.{layers}."):
            ref[hf_name] = value.clone()
        deq = []
        for name, t in _converted(hf_name, value, hp):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"no GGUF name for {name}"
            if ".experts." in name:
                raw = gguf.quants.quantize(
                    np.ascontiguousarray(t.reshape(-1, t.shape[-1])), experts
                )
                raw = np.ascontiguousarray(raw).view(np.uint8).reshape(*t.shape[:2], -1)
                w.add_tensor(gguf_name, raw, raw_dtype=experts)
                d = gguf.quants.dequantize(raw.reshape(-1, raw.shape[-1]), experts)
                deq.append(torch.from_numpy(np.array(d, dtype=np.float32)).reshape(t.shape))
            else:
                w.add_tensor(gguf_name, np.ascontiguousarray(t.numpy()))
        if deq and hf_name in ref:
            ref[hf_name] = torch.cat(deq, dim=1) if len(deq) == 2 else deq[0]
    if mtp:
        d = cfg.hidden_size
        g = torch.Generator().manual_seed(1)
        for leaf, shape in (("eh_proj", (d, 2 * d)), ("enorm", (d,)), ("hnorm", (d,))):
            w.add_tensor(
                f"blk.{layers}.nextn.{leaf}.weight", torch.randn(shape, generator=g).numpy()
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


_ARCH_ENUMS = {"qwen35moe": gguf.MODEL_ARCH.QWEN35MOE, "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}
