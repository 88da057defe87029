"""gpt-oss GGUF files (llama.cpp's `gpt-oss`): the HF config from the metadata keys llama.cpp
reads, completed with what it fixes for the architecture rather than stores (weights/gguf.py
reads the tensors: sinks, biases, MXFP4 experts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetier.errors import CheckpointError

if TYPE_CHECKING:
    from moetier.weights.gguf import _GGUFFile

# What llama.cpp fixes for gpt-oss rather than reads from the file (LLM_ARCH_OPENAI_MOE): the
# clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE: alpha 1.702, limit 7), sliding-window attention on
# every other layer from layer 0 (set_swa_pattern(2)), and yarn's beta_fast 32 / beta_slow 1
# where the file states none. yarn's correction range is not rounded (`truncate: false`), as
# the released gpt-oss configs say (llama.cpp's rope rounds it; transformers follows the config).
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}


def config(file: _GGUFFile, layers: int) -> dict[str, Any]:
    """gpt-oss's HF config from the metadata keys llama.cpp reads (a CheckpointError naming
    the key where llama.cpp or yarn needs one, llama.cpp's defaults elsewhere), completed with
    what llama.cpp fixes."""
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    head_dim = file.head_dim(hidden, heads)
    out: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": int(file.require("expert_feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(file.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(file.require("context_length")),
        "num_local_experts": int(file.require("expert_count")),
        "num_experts_per_tok": int(file.require("expert_used_count")),
        "sliding_window": int(file.require("attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if n % 2 == 0 else "full_attention" for n in range(layers)
        ],
        "rope_parameters": _rope(file),
        "attention_bias": True,
        "tie_word_embeddings": "output.weight" not in file.tensors,
        **_GPT_OSS_SWIGLU,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = file.fields.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            out[key] = int(value)
    return out


def _rope(file: _GGUFFile) -> dict[str, Any]:
    """Rope parameters from `rope.freq_base` (llama.cpp's default 10000) and `rope.scaling.*`:
    yarn (gpt-oss's: factor, original_context_length, betas) or none."""
    theta = float(file.get("rope.freq_base", 10000.0))
    kind = str(file.get("rope.scaling.type", "none"))
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise CheckpointError(
            f"{file.path}: {file.arch}.rope.scaling.type is {kind!r}; gpt-oss uses yarn (or none)"
        )
    for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
        if float(file.get(key, 1.0)) != 1.0:
            raise CheckpointError(
                f"{file.path}: {file.arch}.{key} is {file.get(key)}; moetier runs gpt-oss's "
                f"yarn with 1.0 there (the converter writes none for the released models)"
            )
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(file.require("rope.scaling.factor")),
        "original_max_position_embeddings": int(
            file.require("rope.scaling.original_context_length")
        ),
        **{
            beta: float(file.get(f"rope.scaling.yarn_{beta}", default))
            for beta, default in _YARN_BETAS.items()
        },
        "truncate": False,
    }
