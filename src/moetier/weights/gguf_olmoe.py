"""OLMoE GGUF files (llama.cpp's `olmoe`, OLMoE-1B-7B): the HF config from the metadata keys
llama.cpp reads, with what its graph fixes for the architecture rather than reads.

What llama.cpp's converter (OlmoeModel) does to the model, and how it is read back here:

- Tensors are renamed only, to the names weights/gguf.py's shared tables map back
  (`attn_q`/`attn_k`/`attn_v`/`attn_output`, `attn_q_norm`/`attn_k_norm`: OLMoE's RMSNorms over
  the whole q projection [H * hd] and k projection [Hkv * hd], stored as is; `attn_norm`,
  `ffn_norm`, `ffn_gate_inp` the router [E, D], `output_norm`, `output`). q/k rows are not
  permuted (llama.cpp runs OLMoE with NEOX rope, HF's rotate-half, unlike its llama arch), and
  the norms are not shifted, so there is nothing to invert but the names.
- The routed experts are merged per layer into `blk.N.ffn_{gate,up,down}_exps` [E, rows, cols]
  (read by offset as stored, weights/gguf.py).

Config: `block_count`, `context_length`, `embedding_length`, `feed_forward_length` (the expert
width: OLMoE's experts are its only FFN), `attention.head_count`(`_kv`),
`attention.layer_norm_rms_epsilon` (the converter writes 1e-5, OLMoE's), `expert_count`,
`expert_used_count` (a missing required key is an error naming it), `rope.freq_base` (10000
where unstated, llama.cpp's default). What llama.cpp's olmoe graph fixes rather than reads:
SiLU experts, a softmax router whose top-k weights are not renormalized (norm_topk_prob False),
no bias anywhere, and no clamp of q/k/v (the converter writes no `clamp_kqv` for OLMoE and the
graph applies none, so `clip_qkv` is None: OLMoE-1B-7B's own config states none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetier.errors import CheckpointError

if TYPE_CHECKING:
    from moetier.weights.gguf import _GGUFFile

# GGUF architecture -> the HF architecture (models/registry.py) its tensors load into.
ARCHS = {"olmoe": "OlmoeForCausalLM"}


def config(file: _GGUFFile, layers: int) -> dict[str, Any]:
    """OLMoE's HF config kwargs (model_type "olmoe") from the metadata llama.cpp reads."""
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    head_dim = file.head_dim(hidden, heads)
    if head_dim * heads != hidden:
        raise CheckpointError(
            f"{file.path}: {file.arch}.attention.key_length {head_dim} x {heads} heads is not "
            f"embedding_length {hidden}; OLMoE's heads split the hidden size"
        )
    rot = int(file.get("rope.dimension_count", head_dim))
    if rot != head_dim:  # llama.cpp's olmoe graph asserts n_rot == head size
        raise CheckpointError(
            f"{file.path}: {file.arch}.rope.dimension_count {rot} is not the head size "
            f"{head_dim}; OLMoE rotates whole heads"
        )
    scaling = str(file.get("rope.scaling.type", "none"))
    if scaling != "none":
        raise CheckpointError(
            f"{file.path}: {file.arch}.rope.scaling.type is {scaling!r}; moetier runs olmoe "
            f"files with unscaled rope (as converted from the released models)"
        )
    width = int(file.require("feed_forward_length"))
    gate = file.tensors.get("blk.0.ffn_gate_exps.weight")
    if gate is not None and len(gate.shape) == 3 and gate.shape[1] != width:
        raise CheckpointError(
            f"{file.path}: {file.arch}.feed_forward_length {width} is not the experts' width "
            f"{gate.shape[1]} (blk.0.ffn_gate_exps {list(gate.shape)})"
        )
    out: dict[str, Any] = {
        "architectures": [ARCHS["olmoe"]],
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(file.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(file.require("context_length")),
        "num_experts": int(file.require("expert_count")),
        "num_experts_per_tok": int(file.require("expert_used_count")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(file.get("rope.freq_base", 10000.0)),
        },
        "norm_topk_prob": False,  # llama.cpp: build_moe_ffn(..., norm_w = false, ...)
        "clip_qkv": None,  # llama.cpp's olmoe graph clamps nothing
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = file.fields.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            out[key] = int(value)
    return out
