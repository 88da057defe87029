"""Qwen3.5-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) GGUF files: the HF config from the
metadata llama.cpp reads, and the inverse of every change llama.cpp's converter makes to the
non-expert tensors (weights/gguf.py reads them through `hybrid_tensors`; routed experts are
the plain `blk.N.ffn_{gate,up,down}_exps`, read as stored by `GGUFExpertLayout`).

What llama.cpp's converter (Qwen3NextModel, and for Qwen3.5 `_LinearAttentionVReorderBase`)
writes, and what is undone here:

- Zero-centred RMSNorms stored as `w + 1` (every `*norm.weight` but the Gated DeltaNet's own
  `linear_attn.norm`): `attn_norm`, `post_attention_norm`, `attn_q_norm`, `attn_k_norm`,
  `output_norm`. Read back as `stored - 1` in float32, as transformers' GGUF load does; for
  the stored values of zero-centred weights (in [0.5, 2]) that subtraction is exact, so the
  model's `1 + w` is the stored value.
- `A_log` stored as `ssm_a = -exp(A_log)` (what llama.cpp multiplies by): read back as
  `log(-ssm_a)` in float32.
- `dt_bias` renamed `ssm_dt.bias`; the depthwise conv1d weight [C, 1, K] squeezed to [C, K]
  (`ssm_conv1d`): unsqueezed back.
- Qwen3.5 (`qwen35moe`): the split projections renamed (`in_proj_qkv` -> `attn_qkv`,
  `in_proj_z` -> `attn_gate`, `in_proj_b` -> `ssm_beta`, `in_proj_a` -> `ssm_alpha`,
  `out_proj` -> `ssm_out`), and, where value heads outnumber key heads, the value heads
  reordered from grouped by key head ([Hk, r, ...], HF) to tiled ([r, Hk, ...], for ggml's
  broadcast) on every value-indexed tensor: the value rows of `attn_qkv` and of the conv
  channels, the rows of `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_a`, `ssm_dt`, and the
  columns of `ssm_out`. Grouped back here.
- Qwen3-Next (`qwen3next`): the fused `in_proj_qkvz` ([q, k, v, z] per key head) split into
  `attn_qkv` (all q, all k, all v) and `attn_gate` (all z), regrouped per key head here (older
  files keep it whole as `ssm_in`, read as is); `in_proj_ba` is `ssm_ba` unchanged; no value
  head reorder.
- Full attention: `q_proj` (each head's query and output gate side by side), `k_proj`,
  `v_proj`, `o_proj` as HF stores them (no q/k permutation); the shared expert's gate
  [1, D] as is (`ffn_gate_inp_shexp`).
- Multi-token prediction: the newest converter writes Qwen3.5's MTP block as the extra
  `blk.{num_hidden_layers}` (`nextn_predict_layers`); it is not read. A file holding only
  that block (`mtp-*.gguf`) is an error naming what to pass.

Config: what llama.cpp reads (`ssm.*`, `attention.*`, `rope.*`, `expert_*`; a missing required
key is an error naming it) and what it fixes in code: SiLU, softmax routing with renormalized
top-k, sigmoid-gated shared expert, layer types from `full_attention_interval` (4 where
unstated) unless `attention.recurrent_layers` lists them. The value head width is
`ssm.inner_size / ssm.time_step_rank`, as llama.cpp's graph takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moetier.errors import CheckpointError

# GGUF architecture -> the HF architecture (models/registry.py) its tensors load into.
HYBRID_ARCHS = {
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
}
_MODEL_TYPES = {"qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
_NORMS = {  # stored + 1: GGUF leaf -> HF leaf (model.layers.N.)
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


@dataclass(frozen=True)
class Derived:
    """One HF tensor built from GGUF tensors (`sources`, dequantized to float32) by `build`."""

    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor]


def _layer_types(file: Any, layers: int) -> list[str]:
    """llama.cpp: `attention.recurrent_layers` (one flag per layer) if stated, else every
    `full_attention_interval`-th layer full attention (4 where unstated)."""
    recurrent = file.get("attention.recurrent_layers")
    if recurrent is not None:
        flags = [bool(x) for x in recurrent]
        if len(flags) < layers:
            raise CheckpointError(
                f"{file.path}: {file.arch}.attention.recurrent_layers has {len(flags)} entries "
                f"for {layers} layers"
            )
        return ["linear_attention" if flags[i] else "full_attention" for i in range(layers)]
    interval = int(file.get("full_attention_interval", 4))
    if interval < 1:
        raise CheckpointError(f"{file.path}: {file.arch}.full_attention_interval is {interval}")
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]


def _layers(file: Any) -> int:
    """The decoder layers: `block_count` less the MTP blocks the newest converter appends."""
    return int(file.require("block_count")) - int(file.get("nextn_predict_layers", 0))


def hybrid_config(file: Any) -> dict[str, Any]:
    """HF config kwargs (with `model_type`) of a qwen35moe / qwen3next file, from the metadata
    llama.cpp reads and what it fixes for the architecture."""
    arch = file.arch
    layers = _layers(file)
    if "blk.0.attn_norm.weight" not in file.tensors:
        raise CheckpointError(
            f"{file.path}: holds no decoder layers (blk.0.attn_norm.weight is missing): an "
            f"MTP-only file (`mtp-*.gguf`, the draft block alone); pass the model's GGUF file"
        )
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    head_dim = file.head_dim(hidden, heads)
    value_heads = int(file.require("ssm.time_step_rank"))
    inner = int(file.require("ssm.inner_size"))
    if value_heads < 1 or inner % value_heads:
        raise CheckpointError(
            f"{file.path}: {arch}.ssm.inner_size {inner} is no multiple of "
            f"{arch}.ssm.time_step_rank {value_heads} (value heads)"
        )
    key_heads = int(file.require("ssm.group_count"))
    if key_heads < 1 or value_heads % key_heads:
        raise CheckpointError(
            f"{file.path}: {arch}.ssm.time_step_rank {value_heads} (value heads) is no multiple "
            f"of {arch}.ssm.group_count {key_heads} (key heads)"
        )
    scaling = str(file.get("rope.scaling.type", "none"))
    if scaling != "none":
        raise CheckpointError(
            f"{file.path}: {arch}.rope.scaling.type is {scaling!r}; moetier runs {arch} files "
            f"with unscaled rope (as converted from the released models)"
        )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(file.get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(file.get("rope.dimension_count", head_dim)) / head_dim,
    }
    if arch == "qwen35moe":
        # text positions only: every section rotates by the same position (plain rope); the
        # sections are kept as the config states them (llama.cpp pads them to four)
        sections = [int(s) for s in file.require("rope.dimension_sections")]
        rope.update(mrope_section=sections[:3], mrope_interleaved=True)
    moe = [n for n in range(layers) if f"blk.{n}.ffn_gate_exps.weight" in file.tensors]
    gate = file.tensors.get(f"blk.{moe[0]}.ffn_gate_exps.weight") if moe else None
    shared = file.tensors.get(f"blk.{moe[0]}.ffn_gate_shexp.weight") if moe else None
    width = file.get("expert_feed_forward_length") or (gate.shape[1] if gate else None)
    shared_width = file.get("expert_shared_feed_forward_length") or (
        shared.shape[0] if shared else None
    )
    if width is None or shared_width is None:
        raise CheckpointError(
            f"{file.path}: no expert widths ({arch}.expert_feed_forward_length, "
            f"{arch}.expert_shared_feed_forward_length) and no expert tensors to read them from"
        )
    out: dict[str, Any] = {
        "model_type": _MODEL_TYPES[arch],
        "architectures": [HYBRID_ARCHS[arch]],
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(file.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(file.require("context_length")),
        "num_experts": int(file.require("expert_count")),
        "num_experts_per_tok": int(file.require("expert_used_count")),
        "moe_intermediate_size": int(width),
        "shared_expert_intermediate_size": int(shared_width),
        "linear_conv_kernel_dim": int(file.require("ssm.conv_kernel")),
        "linear_key_head_dim": int(file.require("ssm.state_size")),
        "linear_value_head_dim": inner // value_heads,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "layer_types": _layer_types(file, layers),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    if arch == "qwen3next":
        out.update(
            norm_topk_prob=True,  # llama.cpp: build_moe_ffn(..., norm_w = true, ...)
            decoder_sparse_step=1,
            mlp_only_layers=[n for n in range(layers) if n not in moe],
            intermediate_size=int(file.get("feed_forward_length", width)),
        )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = file.fields.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            out[key] = int(value)
    return out


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    return w - 1.0


def _log_negated(a: torch.Tensor) -> torch.Tensor:
    return torch.log(-a)


def _grouped(
    t: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int, offset: int = 0
) -> torch.Tensor:
    """Undo `_reorder_v_heads`: along `dim`, from `offset` on, value heads tiled [r, Hk, width]
    back to grouped by key head [Hk, r, width]."""
    if per_key == 1:
        return t
    tail = t.narrow(dim, offset, t.shape[dim] - offset)
    if tail.shape[dim] != key_heads * per_key * width:
        raise CheckpointError(
            f"{tail.shape[dim]} value channels are not {key_heads} x {per_key} heads of {width}"
        )
    shape = list(tail.shape)
    split = [*shape[:dim], per_key, key_heads, width, *shape[dim + 1 :]]
    tail = tail.reshape(split).transpose(dim, dim + 1).reshape(shape)
    return torch.cat([t.narrow(dim, 0, offset), tail], dim=dim)


def _qkvz(qkv: torch.Tensor, z: torch.Tensor, key_heads: int, dk: int) -> torch.Tensor:
    """Qwen3-Next's `in_proj_qkvz` ([q, k, v, z] per key head) from the converter's `attn_qkv`
    (all q rows, all k, all v) and `attn_gate` (all z)."""
    d = qkv.shape[-1]
    q, k, v = qkv.split([key_heads * dk, key_heads * dk, qkv.shape[0] - 2 * key_heads * dk])
    parts = [x.reshape(key_heads, -1, d) for x in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, d)


def hybrid_tensors(file: Any, config: Any) -> dict[str, Derived]:
    """HF name -> how to build it from the file's tensors, for every non-expert tensor the
    converter changed (names the plain tables map are left to them). Only tensors whose
    sources are all in the file are listed (a missing one is reported by its HF name)."""
    arch = file.arch
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    r = hv // hk if arch == "qwen35moe" else 1  # qwen3next: value heads as HF orders them
    qk = 2 * hk * dk
    out: dict[str, Derived] = {"model.norm.weight": Derived(("output_norm.weight",), _minus_one)}

    def conv(w: torch.Tensor) -> torch.Tensor:
        return _grouped(w, 0, hk, r, dv, qk).unsqueeze(1)  # [C, K] -> [C, 1, K]

    linear: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]] = {
        "linear_attn.A_log": (("ssm_a",), lambda a: _grouped(_log_negated(a), 0, hk, r, 1)),
        "linear_attn.dt_bias": (("ssm_dt.bias",), lambda b: _grouped(b, 0, hk, r, 1)),
        "linear_attn.conv1d.weight": (("ssm_conv1d.weight",), conv),
        "linear_attn.norm.weight": (("ssm_norm.weight",), lambda w: w),  # no + 1 there
        "linear_attn.out_proj.weight": (("ssm_out.weight",), lambda w: _grouped(w, 1, hk, r, dv)),
    }
    if arch == "qwen35moe":
        linear.update(
            {
                "linear_attn.in_proj_qkv.weight": (
                    ("attn_qkv.weight",),
                    lambda w: _grouped(w, 0, hk, r, dv, qk),
                ),
                "linear_attn.in_proj_z.weight": (
                    ("attn_gate.weight",),
                    lambda w: _grouped(w, 0, hk, r, dv),
                ),
                "linear_attn.in_proj_b.weight": (
                    ("ssm_beta.weight",),
                    lambda w: _grouped(w, 0, hk, r, 1),
                ),
                "linear_attn.in_proj_a.weight": (
                    ("ssm_alpha.weight",),
                    lambda w: _grouped(w, 0, hk, r, 1),
                ),
            }
        )
    else:
        linear["linear_attn.in_proj_ba.weight"] = (("ssm_ba.weight",), lambda w: w)
    for layer in range(int(config.num_hidden_layers)):
        blk = f"blk.{layer}"
        prefix = f"model.layers.{layer}"
        for leaf, hf in _NORMS.items():
            out[f"{prefix}.{hf}.weight"] = Derived((f"{blk}.{leaf}.weight",), _minus_one)
        for hf, (sources, build) in linear.items():
            out[f"{prefix}.{hf}"] = Derived(tuple(f"{blk}.{s}" for s in sources), build)
        if arch == "qwen3next":
            name = f"{prefix}.linear_attn.in_proj_qkvz.weight"
            if f"{blk}.ssm_in.weight" in file.tensors:  # older files: the fused tensor as is
                out[name] = Derived((f"{blk}.ssm_in.weight",), lambda w: w)
            else:
                out[name] = Derived(
                    (f"{blk}.attn_qkv.weight", f"{blk}.attn_gate.weight"),
                    lambda qkv, z: _qkvz(qkv, z, hk, dk),
                )
    return {name: d for name, d in out.items() if all(s in file.tensors for s in d.sources)}
