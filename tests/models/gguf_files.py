"""Tiny GGUF files written from tiny random HF models (gguf.GGUFWriter), and their references.

Names come from llama.cpp's own HF -> GGUF table (`gguf.get_tensor_name_map`), llama-arch q/k
rows are permuted as llama.cpp's converter does, and experts are stored in a GGUF block type:
Q8_0 quantized from the model's weights (`gguf.quants.quantize`), K types as random valid blocks
(the gguf package quantizes no K type). The reference dequantizes the same bytes with
`gguf.quants.dequantize`, so parity holds either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM

from moetier.weights.gguf_quants import GGUF_CODECS, GGUFCodec, random_blocks
from tests.models.parity import randomize

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
ARCH_ENUM = {
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "llama": gguf.MODEL_ARCH.LLAMA,
}

# Shapes whose every matrix has rows of whole K-quant blocks (256 values).
TINY = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)
TINY_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        TINY,
        intermediate_size=512,
        moe_intermediate_size=256,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,  # what transformers assumes for a qwen3moe GGUF
        mlp_only_layers=[],
    ),
    "qwen2_moe": dict(
        TINY,
        intermediate_size=512,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=4,
        mlp_only_layers=[],
    ),
    "mixtral": dict(TINY, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2),
}
Q4_K_M = (T.Q4_K, T.Q4_K, T.Q6_K)  # gate, up, down as llama.cpp's Q4_K_M stores most layers


def tiny_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    config = AutoConfig.for_model(model_type, **{**TINY_FAMILY[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (q/k rows, rotary halves)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_count(cfg.num_local_experts)
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_count(cfg.num_experts)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_expert_used_count(cfg.num_experts_per_tok)


def _encode_experts(
    values: np.ndarray, qtype: T, g: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """[E, rows, cols] float32 -> (stored bytes [E, rows, row bytes], their dequantization)."""
    e, rows, cols = values.shape
    if int(qtype) not in GGUF_CODECS or qtype in (T.F32, T.F16, T.BF16, T.Q8_0):
        raw = gguf.quants.quantize(values.reshape(e * rows, cols), qtype)
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(e, rows, -1)
    else:  # K types: the gguf package quantizes none
        codec = GGUF_CODECS[int(qtype)]
        assert isinstance(codec, GGUFCodec)
        raw = random_blocks(codec, e * rows, cols, 2.0 / cols**0.5, g).numpy().reshape(e, rows, -1)
    ref = gguf.quants.dequantize(raw.reshape(e * rows, -1), qtype).reshape(e, rows, cols)
    return raw, np.ascontiguousarray(ref, dtype=np.float32)


def write_gguf(
    model: Any,
    path: Path,
    expert_types: tuple[T, T, T] | dict[int, tuple[T, T, T]] = Q4_K_M,
    dense_type: T = T.F32,
    tokenizer: Any = None,
    chat_template: str | None = None,
    seed: int = 0,
    per_expert: bool = False,
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF MoE model) as a GGUF file at `path` (experts merged per layer,
    or with `per_expert` one tensor per expert; `expert_types` for all layers or per layer);
    return the reference
    state dict: the model's weights with each stored tensor replaced by gguf's dequantization
    of the bytes written (experts and, with a quantized `dense_type`, 2-D matrices; a K type
    writes random valid blocks there too, as for experts)."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    names = gguf.get_tensor_name_map(ARCH_ENUM[arch], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.model_type}")
    _metadata(w, arch, cfg)
    if tokenizer is not None:
        _tokenizer(w, tokenizer, chat_template)
    g = torch.Generator().manual_seed(seed)
    ref: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        if ".experts." in hf_name:
            layer = hf_name.split(".")[2]
            if hf_name.endswith("gate_up_proj"):
                inter = value.shape[1] // 2
                parts = [("gate", value[:, :inter], 0), ("up", value[:, inter:], 1)]
            else:
                parts = [("down", value, 2)]
            deq = []
            for part, v, k in parts:
                types = expert_types[int(layer)] if isinstance(expert_types, dict) else expert_types
                raw, d = _encode_experts(np.ascontiguousarray(v), types[k], g)
                if per_expert:  # llama.cpp's first Mixtral files: blk.N.ffn_gate.E.weight
                    for e in range(raw.shape[0]):
                        w.add_tensor(
                            f"blk.{layer}.ffn_{part}.{e}.weight", raw[e], raw_dtype=types[k]
                        )
                else:
                    w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=types[k])
                deq.append(d)
            ref[hf_name] = torch.from_numpy(np.concatenate(deq, axis=1))
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        if gguf_name.endswith("ffn_gate_inp_shexp"):
            value = value.reshape(-1)  # llama.cpp stores the shared-expert gate as [D]
        stored = value
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gguf_name.endswith("q") else cfg.num_key_value_heads
            stored = _permute(value, heads)
        block = gguf.GGML_QUANT_SIZES[dense_type][0]
        qtype = dense_type if value.ndim == 2 and value.shape[1] % block == 0 else T.F32
        if qtype == T.F32:
            w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(stored))
            ref[hf_name] = tensor.detach().float().clone()
            continue
        if int(qtype) in GGUF_CODECS and qtype not in (T.F16, T.BF16, T.Q8_0):  # K types
            codec = GGUF_CODECS[int(qtype)]
            assert isinstance(codec, GGUFCodec)
            rows, cols = value.shape
            raw = random_blocks(codec, rows, cols, 2.0 / cols**0.5, g).numpy()
        else:
            raw = gguf.quants.quantize(np.ascontiguousarray(stored), qtype)
        w.add_tensor(f"{gguf_name}.{suffix}", raw, raw_dtype=qtype)
        # dequantized and un-permuted the way transformers loads it
        deq = gguf.quants.dequantize(raw, qtype).reshape(value.shape)
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gguf_name.endswith("q") else cfg.num_key_value_heads
            deq = _unpermute(deq, heads)
        ref[hf_name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _tokenizer(w: gguf.GGUFWriter, tok: Any, chat_template: str | None) -> None:
    """A byte-level BPE tokenizer (e.g. tests/server/tiny.py's) as GGUF metadata."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in tok.added_tokens_decoder.values()}  # llama.cpp: CONTROL
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    if merges:
        w.add_token_merges(merges)
    else:  # byte tokens only: transformers derives (no) merges from scores
        w.add_token_scores([0.0] * len(tokens))
    w.add_eos_token_id(tok.eos_token_id)
    w.add_bos_token_id(tok.eos_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def reference_model(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """The tiny HF model with the GGUF file's dequantized weights (Mixtral: transformers loads
    llama-arch GGUF files as dense Llama, so this is its reference)."""
    model.load_state_dict(state, strict=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def transformers_gguf(path: Path, **config: Any) -> Any:
    """transformers' own GGUF load of the file (dequantizes every tensor), float32."""
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **config
    ).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
