"""The synthetic bench shapes: transformers configs of real MoE models (random weights are
written by bench/synthetic.py), their default depths, and `shape_config` to build one.

Each big shape's numbers come from the released checkpoint's config.json or transformers'
config defaults, said beside it; the tiny-* shapes are for CPU tests.
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_30B = dict(
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
)

_GPT_OSS = dict(
    model_type="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_experts_per_tok=4,
    sliding_window=128,
    vocab_size=201088,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)
# The released gpt-oss configs' (experts stored MXFP4; attention, router, embeddings bf16).
MXFP4_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
MXFP4_SHAPES = {"gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"}

# Qwen3.6-35B-A3B's language model (`qwen3_5_moe_text`, Qwen3_5MoeForCausalLM; the release is
# the multimodal Qwen3_5MoeForConditionalGeneration, whose text_config this is; Qwen3.6-35B-A3B
# has Qwen3.5-35B-A3B's architecture and sizes). Sizes: transformers 5.25 Qwen3_5MoeTextConfig's
# defaults, documented there as Qwen/Qwen3.5-35B-A3B: hidden 2048; 16 query / 2 KV heads of
# 256 (output-gated); Gated DeltaNet with 16 key / 32 value heads of 128, conv kernel 4; every
# layer MoE, 256 experts top-8 of intermediate 512 plus one sigmoid-gated shared expert of 512;
# vocab 248320, untied head; layer_types from the class's full_attention_interval 4 (3 linear :
# 1 full). Written out so a transformers default change cannot move them. Rope and context
# (theta 1e7, 25 % of head_dim rotated, interleaved mrope [11, 11, 10]; 262144 positions) are the
# published Qwen3.5 / Qwen3.6 config.json's, where the class defaults differ (1e4; 32768).
# 40 layers: DEFAULT_LAYERS.
_QWEN3_6_ROPE: dict[str, Any] = dict(
    rope_type="default",
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    mrope_section=[11, 11, 10],
    mrope_interleaved=True,
)
_QWEN3_6_35B = dict(
    model_type="qwen3_5_moe_text",
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    vocab_size=248320,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
    rope_parameters=_QWEN3_6_ROPE,
)

# Gemma-4-26B-A4B's text model (`gemma4_text`, Gemma4ForCausalLM with enable_moe_block; the
# release is the multimodal Gemma4ForConditionalGeneration, whose text_config this is). In
# transformers 5.25 Gemma4TextConfig's defaults are gemma-4-e2b's, so only family-wide values come
# from them: vocab 262144, sliding head_dim 256, gelu_pytorch_tanh, the 5:1 sliding/full layer
# pattern (last layer full), rope (sliding: default, theta 1e4; full: proportional, theta 1e6,
# 25 % rotated), tied embeddings. The 26B-A4B's own sizes are its published config.json's (no
# copy ships with transformers; they agree across public parsers' copies of it, and its EP-plan
# comment names the 2 global KV heads): hidden 2816; a dense GeGLU MLP of 2112 beside 128 routed
# experts top-8 of 704 (per-expert router scale) in every layer; 16 query heads, 8 KV heads on
# sliding layers (window 1024), 2 KV heads of 512 (global_head_dim) with values from the keys
# on full layers; final logit soft-cap 30; 262144 positions; no per-layer embeddings or KV
# sharing. 30 layers: DEFAULT_LAYERS.
_GEMMA4_26B = dict(
    model_type="gemma4_text",
    hidden_size=2816,
    intermediate_size=2112,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    vocab_size=262144,
    tie_word_embeddings=True,
    max_position_embeddings=262144,
)

# GLM-4.5-Air (`glm4_moe`, Glm4MoeForCausalLM): transformers 5.25 Glm4MoeConfig's defaults
# ("GLM-4-MOE-100B-A10B style", i.e. GLM-4.5-Air), which match the published config.json:
# hidden 4096; 96 query / 8 KV heads; layer 0 dense (intermediate 10944), then 128 routed experts
# top-8 of 1408 + 1 shared expert (sigmoid router, 1 group, renormalized, scaling 1.0); vocab
# 151552; 131072 positions; rope theta 1e4 on half of each head (the class's
# partial_rotary_factor 0.5). Published but not class defaults: head_dim 128 (the class would
# take hidden / heads) and q/k/v bias. No MTP layer (model.layers.46 in the release): the
# transformers model has none and moetier never runs it. 46 layers: DEFAULT_LAYERS.
_GLM45_AIR = dict(
    model_type="glm4_moe",
    hidden_size=4096,
    intermediate_size=10944,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    attention_bias=True,
    use_qk_norm=False,
    first_k_dense_replace=1,
    n_routed_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=1408,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    vocab_size=151552,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
)

# DeepSeek-V4-Flash (`deepseek_v4`, DeepseekV4ForCausalLM): the published config.json of
# huggingface.co/deepseek-ai/DeepSeek-V4-Flash (as quoted verbatim in public ports' notes; the
# NVIDIA NeMo AutoModel model page agrees: 43 all-MoE layers, 256 routed + 1 shared experts,
# top-6, hc_mult 4). transformers 5.25 DeepseekV4Config's defaults (its docs name
# DeepSeek-V4-Flash-Base) equal every size: hidden 4096; 64 query heads, 1 KV head of 512 (64
# rotated), q_lora_rank 1024, 8 output groups of o_lora_rank 1024; every layer MoE, 256 experts
# top-6 of 2048 + 1 shared expert of 2048, sqrtsoftplus scores, renormalized, scaled 1.5,
# SwiGLU clamped at 10; layers 0-2 hash-routed (num_hash_layers 3); indexer 64 heads of 128
# keeping 512; window 128; 4 hyper-connection streams, 20 Sinkhorn iterations; vocab 129280,
# untied head; 1048576 positions. Written out so a default change cannot move them. Not class
# defaults: the attention schedule, from the config's compress_ratios (44 entries; the last is
# the MTP block's, which moetier never runs): layers 0-1 window only (ratio 0), then CSA
# (ratio 4) on even and HCA (ratio 128) on odd layers, where the class would open with two HCA
# layers; rope_scaling yarn (factor 16 over 65536 positions, theta 1.6e5) on the compressed
# branches, theta 1e4 plain on the window. The release stores experts FP4 and most other
# matrices FP8 (expert_dtype, quantization_config), which moetier does not read: this shape is
# written bf16. A bf16 expert is 3 x 4096 x 2048 x 2 B = 50.3 MB, a layer's 256 are 12.9 GB,
# all 43 layers' 554.1 GB (568.7 GB with the rest): at most `--layers 4` (54.8 GB) on a 64 GiB
# disk. 43 layers: DEFAULT_LAYERS.
_V4_ATTENTION = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
_V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]
_V4_FLASH_ROPE: dict[str, Any] = dict(  # the compressed layers' (config.json rope_scaling)
    rope_type="yarn",
    factor=16.0,
    original_max_position_embeddings=65536,
    beta_fast=32.0,
    beta_slow=1.0,
)
_V4_FLASH = dict(
    model_type="deepseek_v4",
    hidden_size=4096,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    partial_rotary_factor=64 / 512,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    n_routed_experts=256,
    num_experts_per_tok=6,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    sliding_window=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    layer_types=[_V4_ATTENTION[r] for r in _V4_FLASH_RATIOS],
    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters=_V4_FLASH_ROPE,
    rms_norm_eps=1e-6,
    vocab_size=129280,
    tie_word_embeddings=False,
    max_position_embeddings=1048576,
)

# name: HF config of the shape (without num_hidden_layers); DEFAULT_LAYERS gives the real depth.
SHAPES: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": dict(_GPT_OSS, num_local_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_local_experts=128),
    "qwen3-30b-a3b": _QWEN3_30B,
    "qwen3.6-35b-a3b": _QWEN3_6_35B,
    "gemma-4-26b-a4b": _GEMMA4_26B,
    "glm-4.5-air": _GLM45_AIR,
    "deepseek-v4-flash": _V4_FLASH,
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_attention_heads=16,
        num_key_value_heads=16,
        first_k_dense_replace=1,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        moe_layer_freq=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        vocab_size=102400,
        tie_word_embeddings=False,
        max_position_embeddings=163840,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "olmoe-1b-7b": dict(
        model_type="olmoe",
        hidden_size=2048,
        intermediate_size=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        vocab_size=50304,
    ),
    # Tiny shapes for CI and CPU smoke runs of the bench (same families, toy widths).
    "tiny-qwen3": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "tiny-deepseek-v2": dict(
        model_type="deepseek_v2",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_shared_experts=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    # Rows of whole K-quant blocks (256 values) for the GGUF K formats.
    "tiny-qwen3-k": dict(
        model_type="qwen3_moe",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "tiny-mixtral": dict(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    # Each family's layer kinds at toy widths: layers 0-2 Gated DeltaNet, 3 full attention;
    # sizes as the real shape's where they shape the code path (value heads twice the key heads,
    # one shared expert as wide as a routed one).
    "tiny-qwen3.5-moe": dict(
        _QWEN3_6_35B,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        vocab_size=512,
        max_position_embeddings=512,
        rope_parameters=dict(_QWEN3_6_ROPE, mrope_section=[1, 1, 0]),  # 2 rotated pairs
    ),
    # Layers 0-4 sliding (window 4 < the tests' prompts), 5 full with its own head_dim and KV
    # heads and values from the keys; dense MLP beside 16 experts top-4; soft-capped logits.
    "tiny-gemma4": dict(
        _GEMMA4_26B,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        num_experts=16,
        top_k_experts=4,
        moe_intermediate_size=32,
        sliding_window=4,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    # Layer 0 dense, then 16 experts top-4 + a shared one; head_dim 24 != hidden / heads, half
    # of it rotated; q/k/v bias.
    "tiny-glm4-moe": dict(
        _GLM45_AIR,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    # The first 4 layers of the real schedule: a window of 4 (< the tests' prompts), alone in
    # layers 0-1, plus CSA (rate 4, the indexer keeping 2) in 2 and HCA in 3 at rate 8 (128
    # would compress nothing in a short prompt); hash-routed 0-2, top-k routed 3; 4 streams.
    "tiny-deepseek-v4": dict(
        _V4_FLASH,
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=2,
        sliding_window=4,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        rope_parameters=dict(_V4_FLASH_ROPE, original_max_position_embeddings=32),
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "tiny-gpt-oss": dict(
        model_type="gpt_oss",
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=16,
        num_experts_per_tok=4,
        sliding_window=4,
        vocab_size=512,
        max_position_embeddings=512,
    ),
}
DEFAULT_LAYERS = {
    "gpt-oss-20b": 24,
    "gpt-oss-120b": 36,
    "tiny-gpt-oss": 2,
    "qwen3-30b-a3b": 48,
    "qwen3.6-35b-a3b": 40,
    "gemma-4-26b-a4b": 30,
    "glm-4.5-air": 46,
    "deepseek-v4-flash": 43,
    "deepseek-v2-lite": 27,
    "mixtral-8x7b": 32,
    "olmoe-1b-7b": 16,
    "tiny-qwen3": 2,
    "tiny-qwen3-k": 2,
    "tiny-deepseek-v2": 3,
    "tiny-mixtral": 2,
    "tiny-qwen3.5-moe": 4,
    "tiny-gemma4": 6,
    "tiny-glm4-moe": 3,
    "tiny-deepseek-v4": 4,
}


def shape_config(shape: str, num_layers: int) -> Any:
    """The transformers config of `shape` cut (or grown) to `num_layers` decoder layers."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        from moetier.errors import ConfigError

        raise ConfigError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
    spec = copy.deepcopy(SHAPES[shape])  # the config may edit nested dicts (rope_parameters)
    config = AutoConfig.for_model(spec.pop("model_type"), num_hidden_layers=num_layers, **spec)
    config.dtype = "bfloat16"
    return config
