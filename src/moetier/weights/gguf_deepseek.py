"""GGUF files of the DeepSeek-V3 MoE lineage: llama.cpp's `glm4moe` (GLM-4.5 / 4.6) and
`deepseek2` (DeepSeek-V2 / V2-Lite / V2.5, DeepSeek-V3 / R1, Kimi-K2) architectures.

What weights/gguf.py asks of an architecture it reads through this module: the HF config
(`config`: llama.cpp's metadata keys, as its converter convert_hf_to_gguf.py writes them and
llama.cpp reads them, with what llama.cpp fixes in code), the HF name of each GGUF tensor
(`hf_names`) and the HF tensors the converter split into several GGUF ones (`assembled`).

What the converter does to these models, inverted here:

- both: routed experts merged per layer into `blk.N.ffn_{gate,up,down}_exps` [E, rows, cols]
  (read by offset, weights/gguf.py); `e_score_correction_bias` renamed
  `e_score_correction.bias`, hence `blk.N.exp_probs_b.bias`; shared experts as
  `ffn_{gate,up,down}_shexp` (HF `mlp.shared_experts.*`, n_shared_experts x the expert width
  wide); no q/k row permutation (glm4moe: NEOX rope, HF's rotate-half; deepseek2: llama.cpp's
  NORM rope on the decoupled rope dims, HF's interleaved rope, both left in HF order).
- glm4moe: the NextN/MTP block is written as one more block (`block_count` = layers +
  `nextn_predict_layers`, its extra tensors `blk.N.nextn.*`); it is not run, so the config
  counts the decoder layers only. The post-attention norm is `post_attention_norm` (llama.cpp's
  ATTN_POST_NORM), the partial rotary width `rope.dimension_count` in channels.
- deepseek2: MLA is written as MQA over the latent (`attention.head_count_kv` 1,
  `attention.key_length` kv_lora_rank + rope dims, `value_length` kv_lora_rank; the per-head
  sizes in `key_length_mla` / `value_length_mla`), and `kv_b_proj` [H * (nope + v), r] is
  split per head into `attn_k_b` [H, r, nope] (the key half, transposed) and `attn_v_b`
  [H, v, r]. Files of older converters keep `attn_kv_b` whole and state the per-head sizes in
  `key_length` / `value_length` (no `_mla` keys). The router's function is
  `expert_gating_func` (softmax, as llama.cpp assumes where the key is absent: DeepSeek-V2;
  sigmoid with `exp_probs_b`: DeepSeek-V3), yarn's mscale as `rope.scaling.yarn_log_multiplier`
  = 0.1 x mscale_all_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetier.errors import CheckpointError
from moetier.weights.gguf_names import block_names

if TYPE_CHECKING:
    from moetier.weights.gguf import _GGUFFile

# GGUF architecture -> the HF architecture its tensors load into. deepseek2 files of a softmax
# router (DeepSeek-V2) load as DeepseekV2ForCausalLM instead (`config` says which).
ARCHS = {
    "glm4moe": "Glm4MoeForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
}

# llama.cpp's llama_expert_gating_func_type (expert_gating_func)
_GATING = {1: "softmax", 2: "sigmoid"}

# blk.N.<gguf leaf>.<suffix> -> model.layers.N.<HF leaf>.<suffix>, both architectures
_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate": "mlp.gate_proj",  # the leading dense layers
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCKS = {
    "glm4moe": {
        **_COMMON,
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
    },
    "deepseek2": {
        **_COMMON,
        "attn_q": "self_attn.q_proj",  # no q LoRA (DeepSeek-V2-Lite)
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",  # older converters: kept whole
        "ffn_norm": "post_attention_layernorm",
    },
}


def hf_names(file: _GGUFFile, layers: int) -> dict[str, str]:
    """HF name -> GGUF name of every tensor of the file's `layers` decoder layers the HF model
    holds as stored (the NextN block past them, and `attn_k_b`/`attn_v_b`, left out)."""
    table = {**_BLOCKS[file.arch], "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
    return block_names(file, layers, table)


Combine = Callable[..., torch.Tensor]


def assembled(file: _GGUFFile, config: Any) -> dict[str, tuple[tuple[str, ...], Combine]]:
    """HF name -> (the GGUF tensors it was split into, how to put them back): deepseek2's
    `kv_b_proj` from `attn_k_b` and `attn_v_b` where the file has no `attn_kv_b`."""
    if file.arch != "deepseek2":
        return {}
    out: dict[str, tuple[tuple[str, ...], Combine]] = {}
    for layer in range(int(config.num_hidden_layers)):
        names = (f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight")
        if f"blk.{layer}.attn_kv_b.weight" in file.tensors:
            continue
        if all(n in file.tensors for n in names):
            out[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = (names, _kv_b(file, config))
    return out


def _kv_b(file: _GGUFFile, config: Any) -> Combine:
    heads, nope, v = (
        int(config.num_attention_heads),
        int(config.qk_nope_head_dim),
        int(config.v_head_dim),
    )
    rank = int(config.kv_lora_rank)

    def combine(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
        # the converter: kv_b.view(H, nope + v, r) split into k_b [H, nope, r] (written
        # transposed, [H, r, nope]) and v_b [H, v, r]
        if tuple(k_b.shape) != (heads, rank, nope) or tuple(v_b.shape) != (heads, v, rank):
            raise CheckpointError(
                f"{file.path}: attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do "
                f"not fit the config ([{heads}, {rank}, {nope}] and [{heads}, {v}, {rank}])"
            )
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * (nope + v), rank)

    return combine


def config(file: _GGUFFile, block_count: int) -> tuple[str, dict[str, Any]]:
    """(HF model type, config kwargs) of a glm4moe or deepseek2 file."""
    if file.arch == "glm4moe":
        return "glm4_moe", _glm4moe_config(file, block_count)
    return _deepseek2_config(file, block_count)


def _common(file: _GGUFFile, layers: int) -> dict[str, Any]:
    """What both architectures state the same way: sizes, the MoE block, the router."""
    hidden = int(file.require("embedding_length"))
    dense = int(file.get("leading_dense_block_count", 0))
    moe = [n for n in range(layers) if f"blk.{n}.ffn_gate_exps.weight" in file.tensors]
    if moe != list(range(dense, layers)):
        raise CheckpointError(
            f"{file.path}: {file.arch}.leading_dense_block_count is {dense} but the layers "
            f"with routed experts are {moe}; expected every layer from {dense} on"
        )
    out: dict[str, Any] = {
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": int(file.require("attention.head_count")),
        "rms_norm_eps": float(file.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(file.require("context_length")),
        "first_k_dense_replace": dense,
        "moe_intermediate_size": int(file.require("expert_feed_forward_length")),
        "n_routed_experts": int(file.require("expert_count")),
        "num_experts_per_tok": int(file.require("expert_used_count")),
        "n_shared_experts": int(file.require("expert_shared_count")),
        "routed_scaling_factor": float(file.require("expert_weights_scale")),
        "norm_topk_prob": bool(file.get("expert_weights_norm", False)),
        "n_group": int(file.get("expert_group_count", 1)),
        "topk_group": int(file.get("expert_group_used_count", 1)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    # the dense layers' width; a file of MoE layers only may leave it out
    ff = file.get("feed_forward_length")
    if ff is None and dense:
        gate = file.tensors.get("blk.0.ffn_gate.weight")
        if gate is None:
            file.require("feed_forward_length")  # raises, naming the key
        else:
            ff = gate.shape[0]
    out["intermediate_size"] = int(ff if ff is not None else out["moe_intermediate_size"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = file.fields.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        out[key] = None if value is None else int(value)
    return out


def _nextn(file: _GGUFFile, block_count: int) -> int:
    """The decoder layers: the file's blocks less the NextN/MTP ones it appends."""
    nextn = int(file.get("nextn_predict_layers", 0))
    if not 0 <= nextn < block_count:
        raise CheckpointError(
            f"{file.path}: {file.arch}.nextn_predict_layers is {nextn} of {block_count} blocks"
        )
    return block_count - nextn


def _rope_theta(file: _GGUFFile) -> float:
    return float(file.get("rope.freq_base", 10000.0))  # llama.cpp's default


def _check_gating(file: _GGUFFile, allowed: tuple[str, ...], default: str) -> str:
    code = file.get("expert_gating_func")
    kind = default if code is None or int(code) == 0 else _GATING.get(int(code), str(code))
    if kind not in allowed:
        raise CheckpointError(
            f"{file.path}: {file.arch}.expert_gating_func is {code} ({kind}); moetier runs "
            f"{file.arch} routers with {' or '.join(allowed)}"
        )
    return kind


def _glm4moe_config(file: _GGUFFile, block_count: int) -> dict[str, Any]:
    layers = _nextn(file, block_count)
    out = _common(file, layers)
    heads = out["num_attention_heads"]
    head_dim = file.head_dim(out["hidden_size"], heads)
    rotary = int(file.get("rope.dimension_count", head_dim))  # llama.cpp: n_rot = head size
    _check_gating(file, ("sigmoid",), "sigmoid")  # llama.cpp: sigmoid where the key is absent
    scaling = str(file.get("rope.scaling.type", "none"))
    if scaling != "none":
        raise CheckpointError(
            f"{file.path}: glm4moe.rope.scaling.type is {scaling!r}; GLM-4.5's rope is unscaled "
            f"(moetier reads none)"
        )
    out.update(
        {
            "architectures": [ARCHS["glm4moe"]],
            "num_key_value_heads": int(file.get("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": _rope_theta(file),
                "partial_rotary_factor": rotary / head_dim,
            },
            # optional in llama.cpp's graph: present in the file or not
            "attention_bias": "blk.0.attn_q.bias" in file.tensors,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in file.tensors,
            "num_nextn_predict_layers": block_count - layers,
        }
    )
    return out


def _deepseek2_config(file: _GGUFFile, block_count: int) -> tuple[str, dict[str, Any]]:
    layers = _nextn(file, block_count)
    out = _common(file, layers)
    heads = out["num_attention_heads"]
    rope = int(file.require("rope.dimension_count"))
    rank = int(file.require("attention.kv_lora_rank"))
    if file.get("attention.key_length_mla") is not None:  # the converter since MLA absorption
        k_len = int(file.require("attention.key_length_mla"))
        v_len = int(file.require("attention.value_length_mla"))
    else:  # older converters: the per-head sizes in key_length / value_length
        k_len = int(file.require("attention.key_length"))
        v_len = int(file.require("attention.value_length"))
    q_lora = None
    if "blk.0.attn_q_a.weight" in file.tensors:
        q_lora = int(file.require("attention.q_lora_rank"))
    # llama.cpp assumes softmax where the key is absent (the first DeepSeek-V2 files)
    gating = _check_gating(file, ("softmax", "sigmoid"), "softmax")
    v3 = gating == "sigmoid"
    out.update(
        {
            # MLA is written as MQA (head_count_kv 1); HF's config counts the query heads
            "num_key_value_heads": heads,
            "q_lora_rank": q_lora,
            "kv_lora_rank": rank,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": k_len - rope,
            "v_head_dim": v_len,
            "head_dim": rope,
            "attention_bias": False,
            "rope_parameters": _deepseek2_rope(file),
        }
    )
    if v3:  # sigmoid over scores + exp_probs_b, group top-k by the sum of each group's top 2
        out.update({"architectures": ["DeepseekV3ForCausalLM"], "rope_interleave": True})
        return "deepseek_v3", out
    # DeepSeek-V2: softmax, greedy top-k or, with groups, group-limited greedy (a group scores
    # its best expert); files of converters that wrote no group keys route greedily, as
    # llama.cpp then does
    out.update(
        {
            "architectures": ["DeepseekV2ForCausalLM"],
            "topk_method": "group_limited_greedy" if out["n_group"] > 1 else "greedy",
        }
    )
    return "deepseek_v2", out


def _deepseek2_rope(file: _GGUFFile) -> dict[str, Any]:
    """Rope parameters: none or yarn (DeepSeek-V2/V3's: factor, original context, betas and
    mscale_all_dim from `yarn_log_multiplier`)."""
    theta = _rope_theta(file)
    kind = str(file.get("rope.scaling.type", "none"))
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise CheckpointError(
            f"{file.path}: deepseek2.rope.scaling.type is {kind!r}; DeepSeek uses yarn (or none)"
        )
    for key in (
        "rope.scaling.yarn_ext_factor",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.attn_factor",
    ):
        if float(file.get(key, 1.0)) != 1.0:
            raise CheckpointError(
                f"{file.path}: deepseek2.{key} is {file.get(key)}; moetier runs DeepSeek's yarn "
                f"with 1.0 there (the converter writes none for the released models)"
            )
    # The converter writes 0.1 * mscale_all_dim and not mscale: the released configs have
    # mscale == mscale_all_dim (V2 0.707, V3 1.0), which makes HF's rope attention factor 1
    # and leaves the softmax scale's mscale(factor, mscale_all_dim)^2, as llama.cpp computes.
    mscale = float(file.require("rope.scaling.yarn_log_multiplier")) / 0.1
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(file.require("rope.scaling.factor")),
        "original_max_position_embeddings": int(
            file.require("rope.scaling.original_context_length")
        ),
        # llama.cpp's defaults where the file states none (HF DeepSeek's too)
        "beta_fast": float(file.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(file.get("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


# Pre-tokenizers transformers' GGUF tokenizer splits text like llama.cpp does without an entry
# in its table: GPT-2's own split (the byte-level BPE default)
_GPT2_PRE = ("gpt-2", "default")


def check_tokenizer(path: Path) -> None:
    """Raise a CheckpointError where transformers would build this file's byte-level BPE
    tokenizer with a pre-tokenizer other than the model's: it splits text by llama.cpp's
    `tokenizer.ggml.pre` name from a table of its own and falls back to GPT-2's split for a
    name it lacks (GLM-4.5's "glm4", DeepSeek-V3's "deepseek-v3", DeepSeek-V2's "deepseek-llm",
    Kimi-K2's "kimi-k2"), which encodes text into other tokens than the model was trained on."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:  # another transformers layout: only GPT-2's split is known to match
        GGUF_PRE_TOKENIZER_SPLITS = {}
    metadata, _ = read_gguf_metadata(str(path))
    model = metadata.get("tokenizer.ggml.model")
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if model != "gpt2" or pre in GGUF_PRE_TOKENIZER_SPLITS or pre in _GPT2_PRE:
        return
    raise CheckpointError(
        f"{path}: transformers cannot build this file's tokenizer: it has no pre-tokenizer for "
        f"tokenizer.ggml.pre {pre!r} and would split text unlike the model's own tokenizer. "
        f"Pass the model's Hugging Face tokenizer (a directory or hub name, e.g. "
        f"zai-org/GLM-4.5-Air or deepseek-ai/DeepSeek-V3) as --tokenizer (LLM(..., "
        f"tokenizer=...)), or prompts as token ids encoded with it"
    )
