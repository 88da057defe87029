"""Tiny Gemma 4 MoE text (`gemma4`) GGUF files, written as llama.cpp's converter writes them
(Gemma4Model over Gemma3Model and TextModel: its metadata keys, llama.cpp's tensor names, the
router's scales renamed, experts' gate_up kept fused as `ffn_gate_up_exps`, the full layers'
proportional rope as `rope_freqs`), from tiny random HF models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM

from tests.models.families import FAMILIES
from tests.models.gguf_files import encode_experts
from tests.models.parity import randomize

# Gemma 4's cross-family recipe (sliding and full layers of other head sizes and KV heads,
# values from the keys, proportional rope, soft-capped logits), widened where expert rows must
# be whole blocks: D 64 and I 32 (Q8_0's 32), or D = I = 256 (K types' 256).
GEMMA4_TINY = {
    **FAMILIES["gemma4"].tiny,
    **FAMILIES["gemma4"].main,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
}
GEMMA4_K = {"hidden_size": 256, "moe_intermediate_size": 256}

# Converter-written keys (suffix after "gemma4."), the ones tests may leave out by name
GEMMA4_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.freq_base",
    "rope.freq_base_swa",
    "attention.layer_norm_rms_epsilon",
    "expert_count",
    "expert_used_count",
    "attention.key_length",
    "attention.value_length",
    "final_logit_softcapping",
    "attention.sliding_window",
    "attention.shared_kv_layers",
    "embedding_length_per_layer_input",
    "attention.sliding_window_pattern",
    "attention.key_length_swa",
    "attention.value_length_swa",
    "expert_feed_forward_length",
    "rope.dimension_count",
    "rope.dimension_count_swa",
)


def tiny_gemma4_model(seed: int = 0, **overrides: Any) -> Any:
    config = AutoConfig.for_model("gemma4_text", **{**GEMMA4_TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def _metadata(w: gguf.GGUFWriter, cfg: Any, skip: str | None) -> None:
    """TextModel's, Gemma3Model's, then Gemma4Model's set_gguf_parameters, a later write of a
    key replacing an earlier one (as GGUFWriter does)."""
    rope = cfg.rope_parameters
    full, sliding = rope["full_attention"], rope["sliding_attention"]
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    # config.json's head_dim / num_key_value_heads (the sliding layers') and global_head_dim /
    # num_global_key_value_heads (the full layers'), as the per-layer views hold them
    views = cfg.per_layer_config
    sliding_view, full_view = views[swa.index(True)], views[swa.index(False)]
    head_dim, kv_heads = sliding_view.head_dim, sliding_view.num_key_value_heads
    global_head_dim, global_kv = full_view.head_dim, full_view.num_key_value_heads
    values: dict[str, tuple[Any, Any]] = {}

    def put(key: str, add: Any, value: Any) -> None:
        values[key] = (add, value)

    # TextModel (rope_type "proportional" is unknown to it: no scaling keys)
    put("block_count", w.add_block_count, cfg.num_hidden_layers)
    put("context_length", w.add_context_length, cfg.max_position_embeddings)
    put("embedding_length", w.add_embedding_length, cfg.hidden_size)
    put("feed_forward_length", w.add_feed_forward_length, cfg.intermediate_size)
    put("attention.head_count", w.add_head_count, cfg.num_attention_heads)
    put("attention.head_count_kv", w.add_head_count_kv, kv_heads)
    put("rope.freq_base", w.add_rope_freq_base, float(full["rope_theta"]))
    put("rope.freq_base_swa", w.add_rope_freq_base_swa, float(sliding["rope_theta"]))
    put("attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps, cfg.rms_norm_eps)
    put("expert_count", w.add_expert_count, cfg.num_experts)
    put("expert_used_count", w.add_expert_used_count, cfg.top_k_experts)
    put("attention.key_length", w.add_key_length, head_dim)
    put("attention.value_length", w.add_value_length, head_dim)
    # Gemma3Model
    if cfg.final_logit_softcapping:
        put("final_logit_softcapping", w.add_final_logit_softcapping, cfg.final_logit_softcapping)
    put("attention.sliding_window", w.add_sliding_window, cfg.sliding_window)
    # Gemma4Model
    put("attention.shared_kv_layers", w.add_shared_kv_layers, cfg.num_kv_shared_layers)
    put(
        "embedding_length_per_layer_input",
        w.add_embedding_length_per_layer_input,
        cfg.hidden_size_per_layer_input or 0,
    )
    put("attention.sliding_window_pattern", w.add_sliding_window_pattern, swa)
    put("attention.key_length", w.add_key_length, global_head_dim)
    put("attention.value_length", w.add_value_length, global_head_dim)
    put("attention.key_length_swa", w.add_key_length_swa, head_dim)
    put("attention.value_length_swa", w.add_value_length_swa, head_dim)
    put("expert_feed_forward_length", w.add_expert_feed_forward_length, cfg.moe_intermediate_size)
    # num_global_key_value_heads set (these models): one count per layer
    put("attention.head_count_kv", w.add_head_count_kv, [kv_heads if s else global_kv for s in swa])
    # the top-level rope_parameters has no partial_rotary_factor: sliding layers rotate whole
    put("rope.dimension_count", w.add_rope_dimension_count, global_head_dim)
    put("rope.dimension_count_swa", w.add_rope_dimension_count_swa, head_dim)
    for key, (add, value) in values.items():
        if key != skip:
            add(value)


# A tiny vocabulary as Gemma4Model.set_vocab writes one (256 tokens: the tiny model's): control
# tokens, byte fallbacks, a few merged pieces and unused slots, with its merges
TOKENS = (
    ["<pad>", "<eos>", "<bos>", "<unk>"]
    + [f"<0x{b:02X}>" for b in range(240)]
    + ["\u2581", "h", "i", "\u2581h", "\u2581hi", "<|channel>"]
    + [f"<unused{i}>" for i in range(6)]
)
TOKEN_TYPES = [3, 3, 3, 2] + [6] * 240 + [1] * 5 + [4] + [5] * 6  # llama.cpp's TokenType


def write_tokenizer(w: gguf.GGUFWriter) -> None:
    """Gemma4Model.set_vocab: tokenizer model "gemma4", tokens, scores, types, the merges and
    special ids (SpecialVocab), no space prefix, BOS added."""
    w.add_tokenizer_model("gemma4")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(["\u2581 h", "\u2581h i"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)


def rope_freqs(cfg: Any) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: the full layers' proportional rope factors."""
    full = cfg.rope_parameters["full_attention"]
    head_dim = cfg.per_layer_config[cfg.layer_types.index("full_attention")].head_dim
    rotated = int(head_dim * full["partial_rotary_factor"] / 2)
    unrotated = int(head_dim / 2) - rotated
    return np.array([1.0] * rotated + [1e30] * unrotated, dtype=np.float32)


def write_gemma4_gguf(
    model: Any,
    path: Path,
    experts: tuple[T, T] = (T.Q8_0, T.Q8_0),
    dense_type: T = T.F32,
    skip: str | None = None,
    drop: tuple[str, ...] = (),
    tokenizer: bool = False,
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF Gemma 4 MoE text model) as llama.cpp's converter writes it:
    experts fused gate_up in `experts[0]` and down in `experts[1]` (llama-quantize's types),
    other 2-D weights but the router in `dense_type` (where rows are whole blocks), the rest
    F32; metadata key `skip` and tensors `drop` (GGUF names) left out; with `tokenizer`, the tiny
    vocabulary `TOKENS`. Return the reference
    state dict: HF's tensors, stored ones as gguf dequantizes the bytes written."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("tiny-gemma4")
    _metadata(w, cfg, skip)
    if tokenizer:
        write_tokenizer(w)
    g = torch.Generator().manual_seed(0)
    ref: dict[str, torch.Tensor] = {}
    tensors: list[tuple[str, np.ndarray, T | None]] = [("rope_freqs.weight", rope_freqs(cfg), None)]
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        ref[hf_name] = tensor.detach().float().clone()
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: not in the checkpoint the converter reads
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else ""
        if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # [E, 2I, D] (gate rows, then up) and [E, D, I], unchanged: ffn_gate_up_exps
            fused = hf_name.endswith("gate_up_proj")
            qtype = experts[0] if fused else experts[1]
            raw, deq = encode_experts(np.ascontiguousarray(value), qtype, g)
            part = "gate_up" if fused else "down"
            tensors.append((f"blk.{layer}.ffn_{part}_exps.weight", raw, qtype))
            ref[hf_name] = torch.from_numpy(deq)
            continue
        if hf_name.endswith("router.scale"):
            tensors.append((f"blk.{layer}.ffn_gate_inp.scale", value, None))
            continue
        if hf_name.endswith("router.per_expert_scale"):
            tensors.append((f"blk.{layer}.ffn_down_exps.scale", value, None))
            continue
        # filter_tensors: `layer_scalar` gets ".weight"
        base, suffix = (
            (hf_name, "weight") if hf_name.endswith("layer_scalar") else hf_name.rsplit(".", 1)
        )
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        block = gguf.GGML_QUANT_SIZES[dense_type][0]
        quantize = (
            value.ndim == 2
            and dense_type != T.F32
            and value.shape[1] % block == 0
            and not gguf_name.endswith("ffn_gate_inp")
        )
        if not quantize:
            tensors.append((f"{gguf_name}.{suffix}", value, None))
            continue
        raw = gguf.quants.quantize(np.ascontiguousarray(value), dense_type)
        tensors.append((f"{gguf_name}.{suffix}", raw, dense_type))
        deq = gguf.quants.dequantize(raw, dense_type).reshape(value.shape)
        ref[hf_name] = torch.from_numpy(np.array(deq, dtype=np.float32))
    if cfg.tie_word_embeddings:  # the head is the embedding as stored
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    for name, data, qtype in tensors:
        if name in drop:
            continue
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(data))
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
