"""Tiny GLM-4.5 (`glm4moe`) and DeepSeek-V2/V3 (`deepseek2`) GGUF files, written as llama.cpp's
converter writes them (GLM's NextN block appended; MLA's kv_b_proj split into attn_k_b /
attn_v_b, or whole as older converters kept it), from tiny random HF models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tests.models.families import FAMILIES
from tests.models.gguf_files import TINY_FAMILY, encode_experts, write_tokenizer

# GLM-4.5 and DeepSeek-V2/V3 (llama.cpp's glm4moe and deepseek2): the cross-family recipes with
# D 64 and I 32, rows of whole Q8_0 blocks. GLM keeps head_dim 24 != D / heads (12 channels
# rotate); DeepSeek-V3 runs yarn with mscale 0.707 (the softmax scale's correction is then not
# 1); the DeepSeek-V2 one is V2-Lite's shape (no q LoRA, greedy softmax router).
TINY_FAMILY.update(
    {
        "glm4_moe": {
            **FAMILIES["glm4_moe"].tiny,
            **FAMILIES["glm4_moe"].main,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
        },
        "deepseek_v3": {
            **FAMILIES["deepseek_v3"].tiny,
            **FAMILIES["deepseek_v3"].main,
            "rope_parameters": {
                **FAMILIES["deepseek_v3"].main["rope_parameters"],
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        },
        "deepseek_v2": {
            **FAMILIES["deepseek_v2"].tiny,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.0,
        },
    }
)


def _add_metadata(w: gguf.GGUFWriter, values: list[tuple[str, Any, Any]], skip: str | None) -> None:
    """(key suffix, GGUFWriter method, value) in the converter's order; `skip` left out."""
    for key, add, value in values:
        if key != skip and value is not None:
            add(value)


def _text_model_metadata(w: gguf.GGUFWriter, cfg: Any, block_count: int) -> list[Any]:
    """TextModel.set_gguf_parameters: the keys it writes from an HF config.json."""
    rope = cfg.rope_parameters
    out: list[Any] = [
        ("block_count", w.add_block_count, block_count),
        ("context_length", w.add_context_length, cfg.max_position_embeddings),
        ("embedding_length", w.add_embedding_length, cfg.hidden_size),
        ("feed_forward_length", w.add_feed_forward_length, cfg.intermediate_size),
        ("attention.head_count", w.add_head_count, cfg.num_attention_heads),
        ("attention.head_count_kv", w.add_head_count_kv, cfg.num_key_value_heads),
    ]
    if rope.get("rope_type") == "yarn":
        out += [
            ("rope.scaling.type", w.add_rope_scaling_type, gguf.RopeScalingType.YARN),
            ("rope.scaling.factor", w.add_rope_scaling_factor, rope["factor"]),
            (
                "rope.scaling.original_context_length",
                w.add_rope_scaling_orig_ctx_len,
                rope["original_max_position_embeddings"],
            ),
            ("rope.scaling.yarn_beta_fast", w.add_rope_scaling_yarn_beta_fast, rope["beta_fast"]),
            ("rope.scaling.yarn_beta_slow", w.add_rope_scaling_yarn_beta_slow, rope["beta_slow"]),
        ]
    out += [
        ("rope.freq_base", w.add_rope_freq_base, float(rope["rope_theta"])),
        ("attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
        ("expert_count", w.add_expert_count, cfg.n_routed_experts),
        ("expert_used_count", w.add_expert_used_count, cfg.num_experts_per_tok),
        ("expert_group_count", w.add_expert_group_count, cfg.n_group),
        ("expert_group_used_count", w.add_expert_group_used_count, cfg.topk_group),
    ]
    return out


def _split_experts(
    w: gguf.GGUFWriter, layer: int, hf_name: str, value: np.ndarray, qtype: T
) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """HF's fused experts (gate_up [E, 2I, D], down [E, D, I]) written as the converter merges
    per-expert matrices: `blk.N.ffn_{gate,up,down}_exps` [E, rows, cols] in `qtype`. Return
    gguf's dequantization in HF's layout, and the raw tensors by name."""
    g = torch.Generator().manual_seed(0)
    if hf_name.endswith("gate_up_proj"):
        inter = value.shape[1] // 2
        parts = [("gate", value[:, :inter]), ("up", value[:, inter:])]
    else:
        parts = [("down", value)]
    deq, raws = [], {}
    for part, v in parts:
        raw, d = encode_experts(np.ascontiguousarray(v), qtype, g)
        name = f"blk.{layer}.ffn_{part}_exps.weight"
        w.add_tensor(name, raw, raw_dtype=qtype)
        raws[name] = raw
        deq.append(d)
    return torch.from_numpy(np.concatenate(deq, axis=1)), raws


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_glm4moe_gguf(
    model: Any,
    path: Path,
    experts: T = T.Q8_0,
    skip: str | None = None,
    tokenizer: Any = None,
    pre: str = "glm4",
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF GLM-4.5) as llama.cpp's converter (Glm4MoeModel) writes it:
    its metadata (key `skip` left out), experts merged per layer in `experts`, the rest F32
    under llama.cpp's names, no q/k permutation, and the NextN/MTP block appended as block
    `num_hidden_layers` (`nextn_predict_layers` 1; random tensors, as the tiny HF model has
    none: a reader that ran it would not match); a `tokenizer` with llama.cpp's pre-tokenizer
    name `pre` (GLM-4.5's: "glm4"). Return the reference state dict."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + 1)
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_name("tiny-glm4moe")
    rope = cfg.rope_parameters
    _add_metadata(
        w,
        [
            *_text_model_metadata(w, cfg, layers + 1),
            ("attention.key_length", w.add_key_length, cfg.head_dim),
            ("attention.value_length", w.add_value_length, cfg.head_dim),
            (
                "rope.dimension_count",
                w.add_rope_dimension_count,
                int(cfg.head_dim * rope.get("partial_rotary_factor", 0.5)),
            ),
            (
                "expert_feed_forward_length",
                w.add_expert_feed_forward_length,
                cfg.moe_intermediate_size,
            ),
            ("expert_shared_count", w.add_expert_shared_count, cfg.n_shared_experts),
            (
                "leading_dense_block_count",
                w.add_leading_dense_block_count,
                cfg.first_k_dense_replace,
            ),
            ("expert_gating_func", w.add_expert_gating_func, gguf.ExpertGatingFuncType.SIGMOID),
            ("expert_weights_scale", w.add_expert_weights_scale, cfg.routed_scaling_factor),
            ("expert_weights_norm", w.add_expert_weights_norm, cfg.norm_topk_prob),
            ("nextn_predict_layers", w.add_nextn_predict_layers, 1),
        ],
        skip,
    )
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, None, pre)
    ref: dict[str, torch.Tensor] = {}
    last: dict[str, np.ndarray] = {}  # the last layer's tensors, the MTP block's shapes
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else -1
        if ".experts." in hf_name:
            ref[hf_name], raws = _split_experts(w, layer, hf_name, value, experts)
            if layer == layers - 1:
                last.update(raws)
            continue
        ref[hf_name] = tensor.detach().float().clone()
        # the converter renames e_score_correction_bias to e_score_correction.bias
        base, suffix = hf_name.replace("_bias", ".bias").rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(value))
        if layer == layers - 1:
            last[f"{gguf_name}.{suffix}"] = value
    g = torch.Generator().manual_seed(7)
    mtp = f"blk.{layers}."
    for name, value in last.items():  # the MTP block: the last layer's tensors, other values
        new = name.replace(f"blk.{layers - 1}.", mtp)
        if value.dtype == np.uint8:
            w.add_tensor(new, value[::-1].copy(), raw_dtype=experts)
        else:
            w.add_tensor(new, torch.randn(value.shape, generator=g).numpy())
    d = cfg.hidden_size
    for leaf, shape in (("eh_proj", (d, 2 * d)), ("enorm", (d,)), ("hnorm", (d,))):
        w.add_tensor(f"{mtp}nextn.{leaf}.weight", torch.randn(shape, generator=g).numpy())
    w.add_tensor(f"{mtp}nextn.shared_head_norm.weight", torch.ones(d).numpy())
    _finish(w)
    return ref


def write_deepseek2_gguf(
    model: Any, path: Path, experts: T = T.Q8_0, legacy: bool = False, skip: str | None = None
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF DeepSeek-V2 or V3) as llama.cpp's converter (DeepseekV2Model)
    writes it: MLA as MQA over the latent (head_count_kv 1, key/value lengths of the latent,
    the per-head ones in the `_mla` keys), kv_b_proj split per head into `attn_k_b` (the key
    half transposed, [H, r, nope]) and `attn_v_b` [H, v, r], the router's function from the
    config.json's scoring_func (V3 sigmoid, V2 softmax), yarn's 0.1 x mscale_all_dim. With
    `legacy`, as converters before MLA absorption wrote it: `attn_kv_b` whole, the per-head
    sizes in key/value_length, head_count_kv as the config states, no gating or group keys.
    Experts merged per layer in `experts`, the rest F32; metadata key `skip` left out. Return
    the reference state dict."""
    cfg = model.config
    v3 = cfg.model_type == "deepseek_v3"
    layers = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, layers)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name("tiny-deepseek2")
    rope = cfg.rope_parameters
    nope, rope_dim, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    base_keys = _text_model_metadata(w, cfg, layers)
    if legacy:
        base_keys = [k for k in base_keys if not k[0].startswith("expert_group")]
    else:  # "deepseek2 using MLA converts into MQA"
        base_keys = [
            (k, add, 1 if k == "attention.head_count_kv" else v) for k, add, v in base_keys
        ]
        gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
        base_keys.append(("expert_gating_func", w.add_expert_gating_func, gating))
    lengths = (
        [
            ("attention.key_length", w.add_key_length, nope + rope_dim),
            ("attention.value_length", w.add_value_length, cfg.v_head_dim),
        ]
        if legacy
        else [
            ("attention.key_length", w.add_key_length, rank + rope_dim),
            ("attention.value_length", w.add_value_length, rank),
            ("attention.key_length_mla", w.add_key_length_mla, nope + rope_dim),
            ("attention.value_length_mla", w.add_value_length_mla, cfg.v_head_dim),
        ]
    )
    mscale_all = rope.get("mscale_all_dim")
    _add_metadata(
        w,
        [
            *base_keys,
            (
                "leading_dense_block_count",
                w.add_leading_dense_block_count,
                cfg.first_k_dense_replace,
            ),
            ("vocab_size", w.add_vocab_size, cfg.vocab_size),
            ("attention.q_lora_rank", w.add_q_lora_rank, cfg.q_lora_rank),
            ("attention.kv_lora_rank", w.add_kv_lora_rank, rank),
            *lengths,
            (
                "expert_feed_forward_length",
                w.add_expert_feed_forward_length,
                cfg.moe_intermediate_size,
            ),
            ("expert_shared_count", w.add_expert_shared_count, cfg.n_shared_experts),
            ("expert_weights_scale", w.add_expert_weights_scale, cfg.routed_scaling_factor),
            (
                "expert_weights_norm",
                w.add_expert_weights_norm,
                True if v3 and cfg.norm_topk_prob else None,  # written only when true
            ),
            ("rope.dimension_count", w.add_rope_dimension_count, rope_dim),
            (
                "rope.scaling.yarn_log_multiplier",
                w.add_rope_scaling_yarn_log_mul,
                None if mscale_all is None or rope.get("rope_type") != "yarn" else 0.1 * mscale_all,
            ),
        ],
        skip,
    )
    ref: dict[str, torch.Tensor] = {}
    heads, v_dim = cfg.num_attention_heads, cfg.v_head_dim
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else -1
        if ".experts." in hf_name:
            ref[hf_name], _ = _split_experts(w, layer, hf_name, value, experts)
            continue
        ref[hf_name] = tensor.detach().float().clone()
        if hf_name.endswith("kv_b_proj.weight") and not legacy:
            kv_b = tensor.detach().float().view(heads, nope + v_dim, rank)
            k_b, v_b = torch.split(kv_b, [nope, v_dim], dim=1)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", v_b.contiguous().numpy())
            continue
        base, suffix = hf_name.replace("_bias", ".bias").rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(value))
    _finish(w)
    return ref
