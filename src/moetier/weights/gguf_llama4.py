"""Llama 4 text GGUF files (llama.cpp's `llama4`: Llama-4-Scout/Maverick's language model): the
HF config from the metadata llama.cpp reads, with what its graph fixes for the architecture, and
the HF name of every GGUF tensor.

What weights/gguf.py asks of an architecture it reads through this module: `config` (HF config
kwargs of model type llama4_text) and `hf_names` (HF name -> GGUF name). Routed experts are read
as stored by `GGUFExpertLayout` from `blk.N.ffn_{gate,up,down}_exps`.

What the converter (Llama4Model over LlamaModel and TextModel) writes, and its inverse here:

- q/k rows are not permuted (`undo_permute = False`: Llama 4 rotates adjacent channel pairs,
  HF's complex rope, which is llama.cpp's normal rope), so they are read as stored.
- HF's fused, transposed experts are split and transposed: `feed_forward.experts.gate_up_proj`
  [E, D, 2I] -> `ffn_gate_exps` (its first I columns, transposed to [E, I, D]) and `ffn_up_exps`
  (the last I); `experts.down_proj` [E, I, D] -> `ffn_down_exps` [E, D, I]. GGUFExpertLayout
  reads them as any gate/up/down experts; the Llama 4 family computes the same matrices.
- Renamed only: the router `feed_forward.router` -> `ffn_gate_inp` [E, D], the shared expert
  `ffn_{gate,up,down}_shexp`, the dense layers' MLP `ffn_{gate,up,down}`, `ffn_norm` (HF's
  post_attention_layernorm), attention projections and their biases where the model has them.
- llama3 rope scaling is not in the metadata: the converter writes it as `rope_freqs.weight`,
  one divisor per rotary pair (1 for high frequencies, `factor` for low ones, interpolated
  between). The HF llama3 parameters are read back from those factors (`_llama3_rope`): the
  file does not hold original_max_position_embeddings or the two frequency factors themselves,
  only what they give, so the parameters chosen reproduce the stored factors (checked; the
  released models' own, 8192 with 1 / 1 or 1 / 4, where they fit) rather than restate the
  original config.
- `feed_forward_length` is the dense layers' width (HF's intermediate_size_mlp),
  `expert_feed_forward_length` the experts' and the shared expert's (HF's intermediate_size).

llama.cpp fixes in code, not from keys (so a file cannot state another value): NoPE every 4th
layer (`n_no_rope_layer_step` 4), chunked attention with chunk 8192 in the other layers (the
optional `attention.sliding_window_pattern` period, default 4, picks the chunked layers),
attention temperature tuning in the NoPE layers with floor scale 8192 and scale 0.1, SiLU,
top-k sigmoid routing scaling the expert's input, and the L2 q/k norm in RoPE layers unless the
model has 128 experts (Maverick: use_qk_norm false). `attention.sliding_window` = 0 (the
converter's mark of a model whose layers are all full attention) turns chunking and NoPE off.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from moetier.errors import CheckpointError
from moetier.weights.gguf_names import block_names

if TYPE_CHECKING:
    from moetier.weights.gguf import _GGUFFile

ARCHS = {"llama4": "Llama4ForCausalLM"}

# What llama.cpp's llama4 graph fixes (llama_model_llama4::load_arch_hparams, llama-hparams.h)
NO_ROPE_LAYER_STEP = 4
CHUNK = 8192
TEMP_FLOOR_SCALE = 8192
TEMP_SCALE = 0.1
MAVERICK_EXPERTS = 128  # llama.cpp: use_kq_norm = type != LLM_TYPE_17B_128E

# blk.N.<gguf leaf> -> model.layers.N.<HF leaf> (.weight or .bias follows both)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}
_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")


def hf_names(file: _GGUFFile, layers: int) -> dict[str, str]:
    """HF name -> GGUF name of every non-expert tensor the HF model holds."""
    return block_names(file, layers, _BLOCK_NAMES)


def _llama3_factors(
    inv_freq: np.ndarray, factor: float, low: float, high: float, old_context: float
) -> np.ndarray:
    """The divisor of each inverse frequency under HF's llama3 rope (transformers'
    _compute_llama3_parameters), float64."""
    wavelen = 2 * math.pi / inv_freq
    out = np.where(wavelen > old_context / low, factor, 1.0)
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    if medium.any():
        smooth = (old_context / wavelen[medium] - low) / (high - low)
        out[medium] = 1.0 / ((1 - smooth) / factor + smooth)
    return out


def _tidy(x: float) -> float:
    """x, or the integer it is within float error of (as int)."""
    n = round(x)
    return int(n) if abs(x - n) <= 1e-4 * max(1.0, abs(x)) else x


def _llama3_rope(file: _GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """HF rope_parameters from `rope_freqs.weight` (llama3 scaling as the converter's
    generate_extra_tensors writes it); default rope where the file has none (or all ones)."""
    default = {"rope_type": "default", "rope_theta": theta}
    t = file.tensors.get("rope_freqs.weight")
    if t is None:
        return default
    stored = np.asarray(t.data, dtype=np.float32).reshape(-1).astype(np.float64)
    if stored.size != head_dim // 2:
        raise CheckpointError(
            f"{file.path}: rope_freqs.weight has {stored.size} factors for head size {head_dim} "
            f"({head_dim // 2} expected)"
        )
    if np.all(stored == 1.0):
        return default
    # the converter's frequencies: float32 torch, wavelengths in double
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv64 = inv.astype(np.float64)
    wavelen = 2 * math.pi / inv64
    factor = float(stored.max())
    high = np.flatnonzero(stored == 1.0)
    low = np.flatnonzero(stored == factor)
    medium = np.flatnonzero((stored != 1.0) & (stored != factor))
    # (original context, low, high freq factors): only their ratios matter, so the released
    # models' own are tried first, then a fit at context 8192 rescaled to low_freq_factor 1
    candidates: list[tuple[float, float, float]] = [(8192, 1.0, 1.0), (8192, 1.0, 4.0)]
    old_context = 8192.0
    fit: tuple[float, float] | None = None
    if medium.size == 0:
        # the boundary wavelength lies between the last high and the first low frequency
        below = wavelen[high[-1]] if high.size else wavelen[0] / 2
        boundary = math.sqrt(below * wavelen[low[0]])
        fit = (old_context / boundary, old_context / boundary)
    else:
        # L / w = low (1 - s) + high s for each interpolated pair, s its smoothing weight
        s = (1.0 / stored[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        target = old_context / wavelen[medium]
        if medium.size == 1:  # low boundary between it and the next (low) wavelength
            nxt = wavelen[medium[0] + 1] if medium[0] + 1 < wavelen.size else 2 * wavelen[-1]
            lo = old_context / math.sqrt(wavelen[medium[0]] * nxt)
            fit = (lo, float((target[0] - lo * (1 - s[0])) / s[0]))
        else:
            a = np.stack([1.0 - s, s], axis=1)
            (lo, hi), *_ = np.linalg.lstsq(a, target, rcond=None)
            fit = (float(lo), float(hi))
    if fit is not None and fit[0] > 0:
        lo, hi = fit
        candidates.append((_tidy(old_context / lo), 1.0, _tidy(hi / lo)))
        candidates.append((old_context, lo, hi))
    for context, lo, hi in candidates:
        if hi < lo or (hi == lo and medium.size):
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            got = _llama3_factors(inv64, factor, lo, hi, context)
        if np.allclose(got, stored, rtol=1e-5, atol=0.0):
            return {
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor,
                "low_freq_factor": lo,
                "high_freq_factor": hi,
                "original_max_position_embeddings": context,
            }
    raise CheckpointError(
        f"{file.path}: rope_freqs.weight {stored.tolist()} is not llama3 rope scaling's "
        f"factors for head size {head_dim} and theta {theta} (moetier reads llama4 files with "
        f"llama3-scaled or unscaled rope)"
    )


def config(file: _GGUFFile, layers: int) -> dict[str, Any]:
    """llama4_text HF config kwargs from the metadata llama.cpp reads (a CheckpointError naming
    a key it requires), with what its graph fixes for the architecture."""
    path = file.path
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    head_dim = file.head_dim(hidden, heads)
    rot = int(file.get("rope.dimension_count", head_dim))
    if rot != head_dim:  # llama.cpp: GGML_ASSERT(n_embd_head == n_rot)
        raise CheckpointError(
            f"{path}: llama4.rope.dimension_count {rot} is not the head size {head_dim}; "
            f"Llama 4 rotates whole heads"
        )
    experts = int(file.require("expert_count"))
    if experts == 0:
        raise CheckpointError(
            f"{path}: llama4.expert_count is 0 (a dense MobileLLM model); moetier runs "
            f"mixture-of-experts models"
        )
    step = int(file.require("interleave_moe_layer_step"))
    moe = [n for n in range(layers) if step > 0 and (n + 1) % step == 0]
    routed = [n for n in range(layers) if f"blk.{n}.ffn_gate_inp.weight" in file.tensors]
    if routed != moe:
        raise CheckpointError(
            f"{path}: routers (ffn_gate_inp) in layers {routed}, but "
            f"llama4.interleave_moe_layer_step {step} makes layers {moe} MoE"
        )
    scaling = str(file.get("rope.scaling.type", "none"))
    if scaling != "none":
        raise CheckpointError(
            f"{path}: llama4.rope.scaling.type is {scaling!r}; moetier reads llama4 files with "
            f"llama3 rope scaling (rope_freqs) or none"
        )
    theta = float(file.get("rope.freq_base", 10000.0))  # llama.cpp's default
    theta_swa = file.get("rope.freq_base_swa")
    if theta_swa is not None and float(theta_swa) != theta:
        raise CheckpointError(
            f"{path}: llama4.rope.freq_base_swa {float(theta_swa)} differs from rope.freq_base "
            f"{theta}; Llama 4 has one rope theta"
        )
    window = file.get("attention.sliding_window")
    chunked = window is None or int(window) != 0  # 0: every layer full attention, with rope
    if chunked:
        period = file.get("attention.sliding_window_pattern", 4)
        if isinstance(period, (list, tuple, np.ndarray)):
            raise CheckpointError(
                f"{path}: llama4.attention.sliding_window_pattern is an array; llama.cpp reads "
                f"one period for llama4"
            )
        period = int(period)
        # llama_hparams::set_swa_pattern: chunked unless il % period == period - 1
        swa = [period == 0 or n % period < period - 1 for n in range(layers)]
        no_rope = [int((n + 1) % NO_ROPE_LAYER_STEP != 0) for n in range(layers)]
    else:
        swa = [False] * layers
        no_rope = [1] * layers
    biases = {leaf: f"blk.0.{leaf}.bias" in file.tensors for leaf in _ATTN}
    if len(set(biases.values())) != 1:
        raise CheckpointError(
            f"{path}: attention biases in {[k for k, v in biases.items() if v]} only; Llama 4 "
            f"has them on q, k, v and o or on none (attention_bias)"
        )
    out: dict[str, Any] = {
        "architectures": [ARCHS["llama4"]],
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": int(file.require("expert_feed_forward_length")),
        "intermediate_size_mlp": int(file.require("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(file.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(file.require("context_length")),
        "num_local_experts": experts,
        "num_experts_per_tok": int(file.require("expert_used_count")),
        "interleave_moe_layer_step": step,
        "moe_layers": moe,
        "rope_parameters": _llama3_rope(file, head_dim, theta),
        "no_rope_layers": no_rope,
        "no_rope_layer_interval": NO_ROPE_LAYER_STEP,
        "attention_chunk_size": CHUNK if chunked else None,
        "layer_types": ["chunked_attention" if s else "full_attention" for s in swa],
        "attn_temperature_tuning": True,
        "floor_scale": TEMP_FLOOR_SCALE,
        "attn_scale": TEMP_SCALE,
        "use_qk_norm": experts != MAVERICK_EXPERTS,
        "attention_bias": biases["attn_q"],
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = file.fields.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            out[key] = int(value)
    return out
