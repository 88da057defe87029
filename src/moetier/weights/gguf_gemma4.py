"""Gemma 4 MoE text GGUF files (llama.cpp's `gemma4`, e.g. Gemma-4-26B-A4B's language model):
the HF config from the metadata llama.cpp reads, the HF name of every GGUF tensor, and the HF
tensors llama.cpp's converter leaves out where they are identities.

What weights/gguf.py asks of an architecture it reads through this module: `config` (HF config
kwargs of model type gemma4_text), `hf_names` (HF name -> GGUF name) and `derived` (HF tensors
built from others, or from none). Routed experts are read as stored by `GGUFExpertLayout` from
the fused `blk.N.ffn_gate_up_exps` [E, 2I, D] (gate rows first, HF's `experts.gate_up_proj`
unchanged) and `blk.N.ffn_down_exps` [E, D, I].

What the converter (Gemma4Model, over Gemma3Model and TextModel) writes, and its inverse here:

- Norms as HF stores them (Gemma 4's RMSNorm multiplies by `w`, not `1 + w`: the converter's
  `norm_shift` is 0), under llama.cpp's names: `attn_norm`, `post_attention_norm`, `ffn_norm`
  (the dense MLP's pre-norm), `post_ffw_norm`, `pre_ffw_norm_2`, `post_ffw_norm_1`,
  `post_ffw_norm_2`, `attn_q_norm`, `attn_k_norm`, `output_norm`.
- The router renamed: `router.proj` -> `ffn_gate_inp.weight`, `router.scale` ->
  `ffn_gate_inp.scale`, `router.per_expert_scale` -> `ffn_down_exps.scale` (llama.cpp scales
  each expert's output by it, which is HF's scaling of the routing weight); `layer_scalar` ->
  `layer_output_scale.weight`. Where a file lacks the last two (llama.cpp reads both as
  optional; the converter folds per_expert_scale into NVFP4 experts' scales) they are ones,
  which is what llama.cpp computes with.
- Full attention layers without `attn_v` (attention_k_eq_v: values from the keys).
- The full layers' proportional rope as `rope_freqs.weight` (one factor per rotary pair: 1 for
  the rotated pairs, 1e30 for the rest) with `rope.dimension_count` = the full head size; the
  rotated share is read back from it. Sliding layers rotate every channel
  (`rope.dimension_count_swa` = `attention.key_length_swa`).
- Head sizes: `attention.key_length` is the full layers' (global_head_dim), `key_length_swa`
  the sliding layers' (head_dim); KV heads per layer in `attention.head_count_kv` (an array
  where num_global_key_value_heads is set); layer types in `attention.sliding_window_pattern`
  (one flag per layer, true = sliding).
- The token embedding is cut to the tokenizer's vocabulary (its rows past it are dropped: the
  config's vocab_size becomes the file's rows; nothing to undo for the tokens that exist).

llama.cpp fixes in code: gelu (tanh) MLP and experts, softmax top-k renormalized, attention
scale 1, embeddings times sqrt(hidden). Per-layer embeddings (`embedding_length_per_layer_input`
> 0) and KV sharing (`attention.shared_kv_layers` > 0) pass into the config, where the Gemma 4
family refuses them (Gemma 4 E2B/E4B; no MoE checkpoint uses them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moetier.errors import CheckpointError
from moetier.weights.gguf_hybrid import Derived
from moetier.weights.gguf_names import block_names

if TYPE_CHECKING:
    from moetier.weights.gguf import _GGUFFile

ARCHS = {"gemma4": "Gemma4ForCausalLM"}

# blk.N.<gguf leaf>.<suffix> -> model.layers.N.<HF name>
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale.weight": "layer_scalar",
}
# HF tensors a file may leave out (llama.cpp reads them as optional): ones, as llama.cpp computes
_OPTIONAL_ONES = {
    "layer_output_scale.weight": "layer_scalar",
    "ffn_down_exps.scale": "router.per_expert_scale",
}


def hf_names(file: _GGUFFile, layers: int) -> dict[str, str]:
    """HF name -> GGUF name of every tensor the HF model holds as stored."""
    return block_names(file, layers, _BLOCK_NAMES)


def derived(file: _GGUFFile, config: Any) -> dict[str, Derived]:
    """The optional per-layer scales a file leaves out, as the ones llama.cpp computes with."""
    sizes = {"layer_scalar": 1, "router.per_expert_scale": int(config.num_experts)}
    out: dict[str, Derived] = {}
    for layer in range(int(config.num_hidden_layers)):
        for gguf_leaf, hf in _OPTIONAL_ONES.items():
            if f"blk.{layer}.{gguf_leaf}" not in file.tensors:
                out[f"model.layers.{layer}.{hf}"] = Derived((), _ones(sizes[hf]))
    return out


def _ones(n: int) -> Any:
    return lambda: torch.ones(n)


def _per_layer(file: _GGUFFile, key: str, layers: int, default: Any = None) -> list[Any]:
    """A key llama.cpp reads as one value or one per layer (`get_key_or_arr`)."""
    value = file.require(key) if default is None else file.get(key, default)
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
        if len(values) != layers:
            raise CheckpointError(
                f"{file.path}: gemma4.{key} has {len(values)} entries for {layers} layers"
            )
        return values
    return [value] * layers


def _one(file: _GGUFFile, key: str, values: list[Any], what: str) -> int:
    if len(set(int(v) for v in values)) != 1:
        raise CheckpointError(
            f"{file.path}: gemma4.{key} differs across {what} ({[int(v) for v in values]}); "
            f"Gemma 4 has one value for them"
        )
    return int(values[0])


def _rotated_share(file: _GGUFFile, head_dim: int) -> float:
    """The full layers' proportional-rope share from `rope_freqs` (1 for a rotated pair, 1e30
    for an unrotated one, rotated pairs first: what the converter writes for HF's
    `partial_rotary_factor`)."""
    t = file.tensors.get("rope_freqs.weight")
    if t is None:
        raise CheckpointError(
            f"{file.path}: no rope_freqs.weight (the full attention layers' proportional rope, "
            f"which llama.cpp requires for gemma4)"
        )
    factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
    rotated = int(np.sum(factors == 1.0))
    want = np.array([1.0] * rotated + [1e30] * (factors.size - rotated), dtype=np.float32)
    if factors.size != head_dim // 2 or not np.array_equal(factors, want):
        raise CheckpointError(
            f"{file.path}: rope_freqs.weight is not proportional rope's factors for head size "
            f"{head_dim} (ones, then 1e30, {head_dim // 2} in all)"
        )
    return 2 * rotated / head_dim


def config(file: _GGUFFile, layers: int) -> dict[str, Any]:
    """gemma4_text HF config kwargs from the metadata llama.cpp reads (a CheckpointError naming
    a key it requires), with what it fixes for the architecture."""
    path = file.path
    hidden = int(file.require("embedding_length"))
    heads = _one(
        file, "attention.head_count", _per_layer(file, "attention.head_count", layers), "layers"
    )
    swa = [bool(x) for x in _per_layer(file, "attention.sliding_window_pattern", layers)]
    if swa[-1]:
        raise CheckpointError(
            f"{path}: gemma4.attention.sliding_window_pattern makes the last layer sliding; "
            f"Gemma 4's last layer is full attention"
        )
    full_layers = [n for n in range(layers) if not swa[n]]
    sliding_layers = [n for n in range(layers) if swa[n]]
    # full layers' head size (llama.cpp: hidden / heads where unstated), sliding layers' (required)
    global_head_dim = int(file.get("attention.key_length", hidden // heads))
    head_dim = int(file.require("attention.key_length_swa"))
    for key, size in (("value_length", global_head_dim), ("value_length_swa", head_dim)):
        value = int(
            file.require(f"attention.{key}")
            if key.endswith("swa")
            else file.get(f"attention.{key}", size)
        )
        if value != size:
            raise CheckpointError(
                f"{path}: gemma4.attention.{key} is {value}, its key_length {size} (llama.cpp "
                f"requires them equal for gemma4)"
            )
    key = "attention.head_count_kv"
    kv_heads = _per_layer(file, key, layers, heads)
    kv_full = _one(file, key, [kv_heads[n] for n in full_layers], "full layers")
    kv_swa = kv_full
    if sliding_layers:
        kv_swa = _one(file, key, [kv_heads[n] for n in sliding_layers], "sliding layers")
    # values from the keys (attention_k_eq_v): full layers without attn_v, every sliding one with
    has_v = {n: f"blk.{n}.attn_v.weight" in file.tensors for n in range(layers)}
    k_eq_v = not any(has_v[n] for n in full_layers)
    if any(has_v[n] for n in full_layers) != all(has_v[n] for n in full_layers) or not all(
        has_v[n] for n in sliding_layers
    ):
        raise CheckpointError(
            f"{path}: attn_v is in layers {[n for n in range(layers) if has_v[n]]}; Gemma 4 "
            f"has it in every sliding layer and in every full layer or none (attention_k_eq_v)"
        )
    if not k_eq_v and kv_full != kv_swa:
        raise CheckpointError(
            f"{path}: full layers with attn_v and {kv_full} KV heads, sliding ones with "
            f"{kv_swa}; Gemma 4 gives full layers their own KV heads only with attention_k_eq_v"
        )
    rot = int(file.get("rope.dimension_count", global_head_dim))
    rot_swa = int(file.get("rope.dimension_count_swa", head_dim))
    if rot != global_head_dim or rot_swa != head_dim:
        raise CheckpointError(
            f"{path}: gemma4.rope.dimension_count {rot} / dimension_count_swa {rot_swa}; Gemma "
            f"4 rotates whole heads ({global_head_dim} / {head_dim}; the full layers' share is "
            f"in rope_freqs)"
        )
    scaling = str(file.get("rope.scaling.type", "none"))
    if scaling != "none":
        raise CheckpointError(
            f"{path}: gemma4.rope.scaling.type is {scaling!r}; Gemma 4's rope is unscaled"
        )
    theta = float(file.get("rope.freq_base", 10000.0))  # llama.cpp's default
    moe = [n for n in range(layers) if f"blk.{n}.ffn_gate_inp.weight" in file.tensors]
    if moe != list(range(layers)):
        raise CheckpointError(
            f"{path}: routed experts in layers {moe} of {layers}; moetier runs the Gemma 4 MoE "
            f"model (experts in every layer)"
        )
    ff = _per_layer(file, "feed_forward_length", layers)
    softcap = file.get("final_logit_softcapping")
    out: dict[str, Any] = {
        "architectures": [ARCHS["gemma4"]],
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": _one(file, "feed_forward_length", ff, "layers"),
        "moe_intermediate_size": int(file.require("expert_feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_swa,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "attention_k_eq_v": k_eq_v,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "sliding_window": int(file.require("attention.sliding_window")),
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(file.get("rope.freq_base_swa", theta)),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": _rotated_share(file, global_head_dim),
                "rope_theta": theta,
            },
        },
        "rms_norm_eps": float(file.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(file.require("context_length")),
        "final_logit_softcapping": float(softcap) if softcap else None,
        "num_experts": int(file.require("expert_count")),
        "top_k_experts": int(file.require("expert_used_count")),
        "num_experts_per_tok": int(file.require("expert_used_count")),  # what the engine reads
        "enable_moe_block": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "hidden_size_per_layer_input": int(file.require("embedding_length_per_layer_input")),
        "num_kv_shared_layers": int(file.get("attention.shared_kv_layers", 0)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    if k_eq_v:
        out["num_global_key_value_heads"] = kv_full
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = file.fields.get(f"tokenizer.ggml.{name.replace('pad_', 'padding_')}")
        if token is not None:
            out[name] = int(token)
    return out
