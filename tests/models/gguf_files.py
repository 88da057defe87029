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
from tests.models.parity import PROMPTS, hf_greedy, hf_last_logits, moetier_greedy, randomize

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


def encode_experts(
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
        write_tokenizer(w, tokenizer, chat_template)
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
                raw, d = encode_experts(np.ascontiguousarray(v), types[k], g)
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


def write_tokenizer(
    w: gguf.GGUFWriter, tok: Any, chat_template: str | None, pre: str = "qwen2"
) -> None:
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
        write_tokenizer(w, tokenizer, chat_template, "gpt-4o")  # llama.cpp's name for o200k
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


NEW = 16  # new tokens of the parity tests
# a file's expert types: (gate, up, down), or per MoE layer
Types = tuple[T, T, T] | dict[int, tuple[T, T, T]]


def slot_bytes(experts: Types, d: int, i: int) -> int:
    """One packed expert: gate [I, D], up [I, D], down [D, I] as GGUF blocks, 16-byte aligned
    (per-layer types: the largest layer's)."""
    if isinstance(experts, dict):
        return max(slot_bytes(types, d, i) for types in experts.values())
    total = 0
    for qtype, (rows, cols) in zip(experts, ((i, d), (i, d), (d, i))):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        total += -(-(rows * cols // block * size) // 16) * 16
    return total


def greedy_params(n: int) -> Any:
    from moetier import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_file_parity(
    path: Path, ref: Any, budget: str, top_k: int, label: str, packing: str | None = None
) -> None:
    """A GGUF file on the CPU at `budget` (a byte count: the minimum, top-k slots) keeps its
    experts compressed (in the `packing` named, when given), and its greedy tokens and last
    logits equal `ref`'s (transformers on the weights as written)."""
    from moetier import LLM

    llm = LLM(str(path), expert_budget=budget, device="cpu", dtype="float32", progress=False)
    cache = llm.engine.runner.expert_cache
    assert cache.packing.compressed
    assert packing is None or cache.packing.name == packing, cache.packing.name
    if budget.endswith("B"):
        assert llm.engine.runner.tier_plan.device_slots == top_k
    got = moetier_greedy(llm, PROMPTS, NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(ref, prompt, NEW), f"{label} {budget}: prompt {prompt}"
    torch.testing.assert_close(
        llm.prompt_logits(PROMPTS[0]), hf_last_logits(ref, PROMPTS[0]), rtol=1e-4, atol=1e-4
    )
    cache.check_integrity()
