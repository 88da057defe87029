"""Tiny Llama 4 text (`llama4`) GGUF files, written as llama.cpp's converter writes them
(Llama4Model over LlamaModel and TextModel: its metadata keys, llama.cpp's tensor names, q/k not
permuted, HF's fused transposed experts split into gate / up and transposed, llama3 rope as
`rope_freqs`), from tiny random HF models."""

from __future__ import annotations

import math
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

# Llama 4's cross-family recipe with what llama.cpp fixes for llama4 rather than reads (so a
# file can only hold a model that has it): NoPE every 4th layer (layer 3), chunk 8192 in the
# others, temperature floor 8192 and scale 0.1; MoE in layers 1 and 3 (interleave step 2),
# q/k/v/o biases, L2 q/k norm, llama3 rope (original context 32: two interpolated pairs).
# Widened where expert rows must be whole blocks: D 64 and I 32 (Q8_0's 32), D = I = 256 (K).
LLAMA4_TINY: dict[str, Any] = {
    **FAMILIES["llama4"].tiny,
    "hidden_size": 64,
    "intermediate_size": 32,
    "intermediate_size_mlp": 96,
    "interleave_moe_layer_step": 2,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
    "use_qk_norm": True,
    "attention_bias": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}
LLAMA4_K = {"hidden_size": 256, "intermediate_size": 256}

# Converter-written keys (suffix after "llama4."), the ones tests may leave out by name
LLAMA4_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "expert_count",
    "expert_used_count",
    "attention.key_length",
    "attention.value_length",
    "vocab_size",
    "rope.dimension_count",
    "interleave_moe_layer_step",
    "expert_feed_forward_length",
    "attention.sliding_window",
)


def tiny_llama4_model(seed: int = 0, **overrides: Any) -> Any:
    config = AutoConfig.for_model("llama4_text", **{**LLAMA4_TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def _metadata(w: gguf.GGUFWriter, cfg: Any, skip: str | None) -> None:
    """TextModel's, LlamaModel's, then Llama4Model's set_gguf_parameters over the config
    (Llama4Model swaps intermediate_size_mlp in as feed_forward_length)."""
    values: dict[str, tuple[Any, Any]] = {
        "block_count": (w.add_block_count, cfg.num_hidden_layers),
        "context_length": (w.add_context_length, cfg.max_position_embeddings),
        "embedding_length": (w.add_embedding_length, cfg.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, cfg.intermediate_size_mlp),
        "attention.head_count": (w.add_head_count, cfg.num_attention_heads),
        "attention.head_count_kv": (w.add_head_count_kv, cfg.num_key_value_heads),
        "rope.freq_base": (w.add_rope_freq_base, float(cfg.rope_parameters["rope_theta"])),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
        "expert_count": (w.add_expert_count, cfg.num_local_experts),
        "expert_used_count": (w.add_expert_used_count, cfg.num_experts_per_tok),
        "attention.key_length": (w.add_key_length, cfg.head_dim),
        "attention.value_length": (w.add_value_length, cfg.head_dim),
        "vocab_size": (w.add_vocab_size, cfg.vocab_size),
        "rope.dimension_count": (w.add_rope_dimension_count, cfg.head_dim),
        "interleave_moe_layer_step": (
            w.add_interleave_moe_layer_step,
            cfg.interleave_moe_layer_step,
        ),
        "expert_feed_forward_length": (w.add_expert_feed_forward_length, cfg.intermediate_size),
    }
    if all(t == "full_attention" for t in cfg.layer_types):  # Llama4Model: swa off
        values["attention.sliding_window"] = (w.add_sliding_window, 0)
    for key in LLAMA4_KEYS:
        if key != skip and key in values:
            add, value = values[key]
            add(value)


def rope_freqs(cfg: Any) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: llama3 rope's per-pair divisors (None otherwise)."""
    params = cfg.rope_parameters
    if params.get("rope_type") != "llama3":
        return None
    base, dim = params["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_llama4_gguf(
    model: Any,
    path: Path,
    experts: tuple[T, T, T] = (T.Q8_0,) * 3,
    dense_type: T = T.F32,
    skip: str | None = None,
    tokenizer: Any = None,
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF Llama 4 text model) as llama.cpp's converter writes it: experts
    (gate, up, down) in `experts`, other matrices but the router in `dense_type` (where rows
    are whole blocks), the rest F32; metadata key `skip` left out; with `tokenizer`, a byte-level
    BPE tokenizer under llama.cpp's pre-tokenizer name "llama4". Return the reference state
    dict: HF's tensors, stored ones as gguf dequantizes the bytes written (experts back in HF's
    fused, transposed layout)."""
    from tests.models.gguf_files import write_tokenizer

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "llama4")
    w.add_name("tiny-llama4")
    _metadata(w, cfg, skip)
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, None, "llama4")
    g = torch.Generator().manual_seed(0)
    ref: dict[str, torch.Tensor] = {}
    freqs = rope_freqs(cfg)
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        ref[hf_name] = tensor.detach().float().clone()
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else ""
        if hf_name.endswith("experts.gate_up_proj"):  # [E, D, 2I] -> gate, up [E, I, D]
            inter = value.shape[-1] // 2
            parts = np.swapaxes(value, -1, -2)
            deq = []
            for part, rows, qtype in (
                ("gate", parts[:, :inter], experts[0]),
                ("up", parts[:, inter:], experts[1]),
            ):
                raw, d = encode_experts(np.ascontiguousarray(rows), qtype, g)
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=qtype)
                deq.append(d)
            ref[hf_name] = torch.from_numpy(
                np.ascontiguousarray(np.swapaxes(np.concatenate(deq, 1), -1, -2))
            )
            continue
        if hf_name.endswith("experts.down_proj"):  # [E, I, D] -> [E, D, I]
            raw, d = encode_experts(np.ascontiguousarray(np.swapaxes(value, -1, -2)), experts[2], g)
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", raw, raw_dtype=experts[2])
            ref[hf_name] = torch.from_numpy(np.ascontiguousarray(np.swapaxes(d, -1, -2)))
            continue
        base, suffix = hf_name.rsplit(".", 1)
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
            w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(value))
            continue
        raw_dense = gguf.quants.quantize(np.ascontiguousarray(value), dense_type)
        w.add_tensor(f"{gguf_name}.{suffix}", raw_dense, raw_dtype=dense_type)
        deq_dense = gguf.quants.dequantize(raw_dense, dense_type).reshape(value.shape)
        ref[hf_name] = torch.from_numpy(np.array(deq_dense, dtype=np.float32))
    if cfg.tie_word_embeddings:
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
