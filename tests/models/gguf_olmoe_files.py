"""Tiny OLMoE (`olmoe`) GGUF files, written as llama.cpp's converter (OlmoeModel) writes them,
from tiny random HF models: TextModel's metadata with the rms epsilon fixed to 1e-5, tensors
renamed by llama.cpp's own table (no q/k permutation: OLMoE runs NEOX rope), experts merged
per layer into `blk.N.ffn_{gate,up,down}_exps` and stored in a GGUF block type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM

from tests.models.families import FAMILIES
from tests.models.gguf_files import Types, encode_experts, write_tokenizer
from tests.models.parity import randomize

# The cross-family recipe widened to D 256 and I 256 (rows of whole K-quant blocks), two
# layers, a rope theta other than llama.cpp's default (so `rope.freq_base` must be read).
# clip_qkv off: llama.cpp's olmoe graph clamps nothing and its converter writes no clamp_kqv
# (OLMoE-1B-7B's config states none), so a clamping model's file would not run as
# transformers runs it there either.
OLMOE_TINY: dict[str, Any] = {
    **FAMILIES["olmoe"].tiny,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "clip_qkv": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
}
OLMOE_KEYS = (  # what the converter writes (by key suffix), in its order
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "expert_used_count",
    "expert_count",
)
# OlmoeModel.set_gguf_parameters writes the rms epsilon again, as 1e-5, over the config's
OLMOE_RMS_EPS = 1e-5


def tiny_olmoe_model(seed: int = 0, **overrides: Any) -> Any:
    config = AutoConfig.for_model("olmoe", **{**OLMOE_TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def _metadata(w: gguf.GGUFWriter, cfg: Any, skip: str | None) -> None:
    """TextModel.set_gguf_parameters over OLMoE's config.json (no head_dim there, so no
    key/value lengths; `num_experts` written by OlmoeModel), then OlmoeModel's 1e-5."""
    values: dict[str, tuple[Any, Any]] = {
        "block_count": (w.add_block_count, cfg.num_hidden_layers),
        "context_length": (w.add_context_length, cfg.max_position_embeddings),
        "embedding_length": (w.add_embedding_length, cfg.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, cfg.intermediate_size),
        "attention.head_count": (w.add_head_count, cfg.num_attention_heads),
        "attention.head_count_kv": (w.add_head_count_kv, cfg.num_key_value_heads),
        "rope.freq_base": (w.add_rope_freq_base, float(cfg.rope_parameters["rope_theta"])),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, OLMOE_RMS_EPS),
        "expert_used_count": (w.add_expert_used_count, cfg.num_experts_per_tok),
        "expert_count": (w.add_expert_count, cfg.num_experts),
    }
    for key in OLMOE_KEYS:
        if key != skip:
            add, value = values[key]
            add(value)


def write_olmoe_gguf(
    model: Any,
    path: Path,
    experts: Types = (T.Q8_0,) * 3,
    dense_type: T = T.F32,
    skip: str | None = None,
    seed: int = 0,
    tokenizer: Any = None,
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF OLMoE) as llama.cpp's converter writes it: experts (gate, up,
    down) in `experts` (Q8_0 quantized from the weights; K types as random valid blocks, the
    gguf package quantizing none), other matrices but the router in `dense_type` (F32 or Q8_0,
    as llama-quantize keeps `ffn_gate_inp` and 1-D tensors F32), the rest F32; metadata key
    `skip` left out; a byte-level BPE `tokenizer` under llama.cpp's pre-tokenizer name for
    OLMoE ("olmo": GPT-2's split). Return the reference state dict: the model's weights with
    each stored tensor as gguf dequantizes the bytes written (experts in HF's fused layout)."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.OLMOE, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_name("tiny-olmoe")
    _metadata(w, cfg, skip)
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, None, "olmo")
    g = torch.Generator().manual_seed(seed)
    ref: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        if ".experts." in hf_name:  # HF fused [E, 2I, D] / [E, D, I]: the converter's stack
            layer = int(hf_name.split(".")[2])
            kinds = experts[layer] if isinstance(experts, dict) else experts
            if hf_name.endswith("gate_up_proj"):
                inter = value.shape[1] // 2
                parts = [("gate", value[:, :inter], 0), ("up", value[:, inter:], 1)]
            else:
                parts = [("down", value, 2)]
            deq = []
            for part, v, k in parts:
                raw, d = encode_experts(np.ascontiguousarray(v), kinds[k], g)
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=kinds[k])
                deq.append(d)
            ref[hf_name] = torch.from_numpy(np.concatenate(deq, axis=1))
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        quantize = value.ndim == 2 and not gguf_name.endswith("ffn_gate_inp")
        if not quantize or dense_type == T.F32:
            w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(value))
            ref[hf_name] = tensor.detach().float().clone()
            continue
        raw_dense = gguf.quants.quantize(np.ascontiguousarray(value), dense_type)
        w.add_tensor(f"{gguf_name}.{suffix}", raw_dense, raw_dtype=dense_type)
        d_dense = gguf.quants.dequantize(raw_dense, dense_type).reshape(value.shape)
        ref[hf_name] = torch.from_numpy(np.array(d_dense, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
