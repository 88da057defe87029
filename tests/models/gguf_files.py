"""Tiny GGUF files written from tiny random HF models (gguf.GGUFWriter), and their references.

Names come from llama.cpp's own HF -> GGUF table (`gguf.get_tensor_name_map`), llama-arch q/k
rows are permuted as llama.cpp's converter does, and experts are stored in a GGUF block type:
Q8_0 quantized from the model's weights (`gguf.quants.quantize`), K types as random valid blocks
(the gguf package quantizes no K type). The reference dequantizes the same bytes with
`gguf.quants.dequantize`, so parity holds either way.

gpt-oss (`write_gpt_oss_gguf`) is written as llama.cpp's converter (GptOssModel) writes it: its
metadata, experts split from HF's interleaved gate_up (weights and biases: gate = even rows or
columns, up = odd), MXFP4 experts repacked from the HF MXFP4 blocks and scales into ggml's
`block_mxfp4` (scale byte first, element j and j + 16 in byte j), or, from float experts,
quantized to another type after the transpose.
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
from moetier.weights.mxfp4 import quantize as mxfp4_quantize
from tests.models.families import FAMILIES
from tests.models.parity import randomize

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "gpt_oss": "gpt-oss"}
ARCH_ENUM = {
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
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
    # the cross-family recipe (D 64, I 32: rows of whole MXFP4 and Q8_0 blocks), sliding
    # window 4, yarn rope
    "gpt_oss": {**FAMILIES["gpt_oss"].tiny, **FAMILIES["gpt_oss"].main},
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


def _tokenizer(w: gguf.GGUFWriter, tok: Any, chat_template: str | None, pre: str = "qwen2") -> None:
    """A byte-level BPE tokenizer (e.g. tests/server/tiny.py's) as GGUF metadata, with
    llama.cpp's pre-tokenizer name `pre`."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in tok.added_tokens_decoder.values()}  # llama.cpp: CONTROL
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
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


def hf_mxfp4_experts(model: Any) -> dict[str, torch.Tensor]:
    """The model's experts as the released gpt-oss checkpoints store them (what
    tests/models/test_gpt_oss.py's `to_mxfp4` saves): `{gate_up,down}_proj_blocks`
    [E, rows, cols/32, 16] and `_scales` [E, rows, cols/32], rows as in HF's transposed
    float tensor (gate_up's interleaved)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            pairs = [mxfp4_quantize(t[e].t()) for e in range(t.shape[0])]
            out[name + "_blocks"] = torch.stack([b for b, _ in pairs])
            out[name + "_scales"] = torch.stack([s for _, s in pairs])
    return out


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """HF MXFP4 (blocks [E, rows, G, 16]: element 2k low nibble of byte k, 2k + 1 high;
    scales [E, rows, G]) -> ggml `block_mxfp4` bytes [E, rows, G * 17], as llama.cpp's
    converter repacks them: per block the scale byte, then byte j holding element j in its
    low nibble and element j + 16 in its high one."""
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., 32]
    qs = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    packed = torch.cat([scales.unsqueeze(-1), qs], dim=-1)  # [E, rows, G, 17]
    return packed.flatten(-2).numpy()


GPT_OSS_KEYS = (  # the metadata llama.cpp's converter writes for gpt-oss (by key suffix)
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "expert_count",
    "expert_used_count",
    "attention.key_length",
    "attention.value_length",
    "attention.sliding_window",
    "expert_feed_forward_length",
)


def _gpt_oss_metadata(w: gguf.GGUFWriter, cfg: Any, skip: str | None) -> None:
    """TextModel.set_gguf_parameters, then GptOssModel's (sliding window, expert width)."""
    rope = cfg.rope_parameters
    yarn = rope.get("rope_type") == "yarn"
    values: dict[str, Any] = {
        "block_count": w.add_block_count,
        "context_length": w.add_context_length,
        "embedding_length": w.add_embedding_length,
        "feed_forward_length": w.add_feed_forward_length,
        "attention.head_count": w.add_head_count,
        "attention.head_count_kv": w.add_head_count_kv,
        "rope.freq_base": w.add_rope_freq_base,
        "attention.layer_norm_rms_epsilon": w.add_layer_norm_rms_eps,
        "expert_count": w.add_expert_count,
        "expert_used_count": w.add_expert_used_count,
        "attention.key_length": w.add_key_length,
        "attention.value_length": w.add_value_length,
        "attention.sliding_window": w.add_sliding_window,
        "expert_feed_forward_length": w.add_expert_feed_forward_length,
    }
    if yarn:
        values.update(
            {
                "rope.scaling.type": w.add_rope_scaling_type,
                "rope.scaling.factor": w.add_rope_scaling_factor,
                "rope.scaling.original_context_length": w.add_rope_scaling_orig_ctx_len,
                "rope.scaling.yarn_beta_fast": w.add_rope_scaling_yarn_beta_fast,
                "rope.scaling.yarn_beta_slow": w.add_rope_scaling_yarn_beta_slow,
            }
        )
    args = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.scaling.type": gguf.RopeScalingType.YARN,
        "rope.scaling.factor": rope.get("factor"),
        "rope.scaling.original_context_length": rope.get("original_max_position_embeddings"),
        "rope.scaling.yarn_beta_fast": rope.get("beta_fast"),
        "rope.scaling.yarn_beta_slow": rope.get("beta_slow"),
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "expert_count": cfg.num_local_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "attention.sliding_window": cfg.sliding_window,
        "expert_feed_forward_length": cfg.intermediate_size,
    }
    for key in GPT_OSS_KEYS:
        if key in values and key != skip:
            values[key](args[key])


def write_gpt_oss_gguf(
    model: Any,
    path: Path,
    experts: T = T.MXFP4,
    dense_type: T = T.F32,
    tokenizer: Any = None,
    chat_template: str | None = None,
    skip: str | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` (a tiny HF gpt-oss) as llama.cpp's converter writes gpt-oss: MXFP4
    experts repacked from the HF MXFP4 checkpoint's blocks (`hf_mxfp4_experts`), or experts
    of another type quantized from the float weights; other 2-D weights but the router in
    `dense_type`, the rest F32; metadata key `skip` left out. Return the reference state
    dict (experts and quantized weights as gguf dequantizes the bytes written, in HF's
    layout: gate_up [E, D, 2I] interleaved, down [E, I, D])."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name("tiny-gpt-oss")
    _gpt_oss_metadata(w, cfg, skip)
    if tokenizer is not None:
        _tokenizer(w, tokenizer, chat_template, "gpt-4o")  # llama.cpp's name for o200k
    mx = hf_mxfp4_experts(model) if experts == T.MXFP4 else {}
    ref: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else ""
        if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            part = "gate_up" if hf_name.endswith("gate_up_proj") else "down"
            if experts == T.MXFP4:  # [E, rows, G, 16] + [E, rows, G], rows as transposed
                blocks, scales = mx[hf_name + "_blocks"], mx[hf_name + "_scales"]
                mats = (
                    {"down": (blocks, scales)}
                    if part == "down"
                    else {
                        "gate": (blocks[:, 0::2], scales[:, 0::2]),
                        "up": (blocks[:, 1::2], scales[:, 1::2]),
                    }
                )
                raws = {k: ggml_mxfp4(b, s) for k, (b, s) in mats.items()}
            else:  # float experts: transposed to [E, rows, cols], gate/up de-interleaved
                rows = value.transpose(-1, -2)
                mats_f = (
                    {"down": rows}
                    if part == "down"
                    else {"gate": rows[:, 0::2], "up": rows[:, 1::2]}
                )
                raws = {}
                for k, v in mats_f.items():
                    e, r, c = v.shape
                    q = gguf.quants.quantize(np.ascontiguousarray(v.reshape(e * r, c)), experts)
                    raws[k] = np.ascontiguousarray(q).view(np.uint8).reshape(e, r, -1)
            deq = {}
            for k, raw in raws.items():
                w.add_tensor(f"blk.{layer}.ffn_{k}_exps.weight", raw, raw_dtype=experts)
                e, r = raw.shape[:2]
                d = gguf.quants.dequantize(raw.reshape(e * r, -1), experts).reshape(e, r, -1)
                deq[k] = torch.from_numpy(np.array(d, dtype=np.float32))
            if part == "down":
                ref[hf_name] = deq["down"].transpose(-1, -2).contiguous()
            else:  # re-interleaved: rows 2i gate, 2i + 1 up
                both = torch.stack([deq["gate"], deq["up"]], dim=2).flatten(1, 2)
                ref[hf_name] = both.transpose(-1, -2).contiguous()
            continue
        ref[hf_name] = value.clone()
        if hf_name.endswith("gate_up_proj_bias"):
            for k, v in (("gate", value[..., 0::2]), ("up", value[..., 1::2])):
                w.add_tensor(f"blk.{layer}.ffn_{k}_exps.bias", np.ascontiguousarray(v.numpy()))
            continue
        if hf_name.endswith("down_proj_bias"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.bias", value.numpy())
            continue
        # the converter names sinks `...self_attn.sinks.weight`
        base, suffix = (hf_name, "weight") if hf_name.endswith("sinks") else hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        quantize = value.dim() == 2 and suffix == "weight" and "ffn_gate_inp" not in gguf_name
        if not quantize or dense_type == T.F32:
            w.add_tensor(f"{gguf_name}.{suffix}", value.numpy())
            continue
        raw = gguf.quants.quantize(np.ascontiguousarray(value.numpy()), dense_type)
        w.add_tensor(f"{gguf_name}.{suffix}", raw, raw_dtype=dense_type)
        deq_dense = gguf.quants.dequantize(raw, dense_type).reshape(value.shape)
        ref[hf_name] = torch.from_numpy(np.array(deq_dense, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


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
        _tokenizer(w, tokenizer, chat_template, "qwen35" if arch == "qwen35moe" else "qwen2")
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
        raw, d = _encode_experts(np.ascontiguousarray(v), qtype, g)
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
        _tokenizer(w, tokenizer, None, pre)
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
