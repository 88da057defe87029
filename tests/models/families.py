"""One tiny checkpoint recipe per family, shared by every cross-family suite (CPU, grouped, GPU).

`tiny` is the family's shape; `main` adds what the main checkpoint exercises on top of it and
`fused` what the fused-layout checkpoint exercises instead (a second router or rope variant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.models.parity import fuse_experts, make_checkpoint


@dataclass(frozen=True)
class Family:
    model_type: str
    tiny: dict[str, Any]
    routed_experts: int  # MoE layers x experts per layer in the main checkpoint
    # Disk-tier case: (expert budget, host budget below the routed bytes), and the host rows
    # that host budget buys. With top-4 of 8 a step touches most experts of a layer, so an LRU
    # host tier at half the routed bytes is cycled through and never hit; 75% still is partial.
    host_case: tuple[str, str]
    host_rows: int
    main: dict[str, Any] = field(default_factory=dict)
    fused: dict[str, Any] = field(default_factory=dict)

    def checkpoint(self, path: Path, seed: int = 0, **overrides: Any) -> Path:
        return make_checkpoint(
            path, self.model_type, seed, **{**self.tiny, **self.main, **overrides}
        )

    def fused_checkpoint(self, path: Path) -> Path:
        make_checkpoint(path, self.model_type, 1, **{**self.tiny, **self.fused})
        fuse_experts(path)
        return path


_DEEPSEEK_MLA = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,  # layer 0 dense: two MoE layers
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)

_HYBRID = dict(
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    vocab_size=256,
    max_position_embeddings=256,
)

FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        "mixtral",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=24,
        host_case=("25%", "50%"),
        host_rows=12,
    ),
    # Shared expert with its sigmoid gate, q/k/v bias; layer 1 dense (mlp_only_layers).
    "qwen2_moe": Family(
        "qwen2_moe",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=4,
            mlp_only_layers=[1],
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=16,
        host_case=("50%", "75%"),
        host_rows=12,
    ),
    # Per-head q/k norm; head_dim 32 != hidden / heads (16), as in real configs; layer 0 dense.
    "qwen3_moe": Family(
        "qwen3_moe",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=16,
        host_case=("50%", "75%"),
        host_rows=12,
    ),
    # Full-projection q/k norm; clip_qkv 1.0 clamps many normed q/k and raw v entries, so the
    # clamp-versus-norm order matters.
    "olmoe": Family(
        "olmoe",
        dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=4,
            clip_qkv=1.0,
            vocab_size=256,
            max_position_embeddings=256,
            eos_token_id=2,  # the default eos id lies outside the tiny vocab
        ),
        routed_experts=24,
        host_case=("50%", "75%"),
        host_rows=18,
    ),
    # MLA without q LoRA (as V2-Lite), softmax routers. Main: group_limited_greedy. Fused:
    # greedy, with norm_topk_prob set (HF's V2 router ignores it) and a scaling HF applies.
    "deepseek_v2": Family(
        "deepseek_v2",
        dict(
            _DEEPSEEK_MLA,
            q_lora_rank=None,
            n_routed_experts=16,
            num_experts_per_tok=3,
            n_shared_experts=2,
        ),
        routed_experts=32,
        host_case=("25%", "50%"),
        host_rows=16,
        main=dict(
            topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.0
        ),
        fused=dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            topk_method="greedy",
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
        ),
    ),
    # MLA with q LoRA, sigmoid group-limited router with correction bias and routed scaling.
    # Main: interleaved rope with yarn (the softmax scale carries the mscale correction) and
    # normalized top-k. Fused: rotate-half rope, no normalization, other group shape.
    "deepseek_v3": Family(
        "deepseek_v3",
        dict(
            _DEEPSEEK_MLA,
            q_lora_rank=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
        routed_experts=32,
        host_case=("25%", "50%"),
        host_rows=16,
        main=dict(rope_parameters=YARN, norm_topk_prob=True, rope_interleave=True),
        fused=dict(
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            rope_interleave=False,
        ),
    ),
    # GQA with partial rotary (head_dim 24 != hidden / heads, 12 channels rotate), q/k/v bias,
    # per-head q/k norm; hidden 80 (not a power of two); layer 0 dense; DeepSeek-V3's sigmoid
    # group-limited router with correction bias and routed scaling; one shared expert. Fused:
    # no bias or q/k norm, a quarter of the channels rotate, one group, no renormalization.
    "glm4_moe": Family(
        "glm4_moe",
        dict(
            hidden_size=80,
            intermediate_size=112,
            moe_intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            partial_rotary_factor=0.5,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=24,
        host_case=("50%", "75%"),
        host_rows=18,
        main=dict(
            attention_bias=True,
            use_qk_norm=True,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        fused=dict(
            partial_rotary_factor=0.25,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
        ),
    ),
    # Llama 4 text: experts fused and transposed on disk, top-1 sigmoid router scaling the
    # expert's input, shared expert; layers 1 and 3 MoE (interleave step 2); layers 0 and 2
    # RoPE with L2 q/k norm and chunked attention (chunk 8 < the prompts + 32 new tokens), 1
    # and 3 NoPE with temperature tuning (floor_scale 4: the scale changes within the test);
    # hidden 72, head_dim 24 != hidden / heads. Fused (already fused): llama3 rope, every layer
    # MoE and full attention, no q/k norm or temperature.
    "llama4": Family(
        "llama4_text",
        dict(
            hidden_size=72,
            intermediate_size=40,
            intermediate_size_mlp=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            num_local_experts=8,
            num_experts_per_tok=1,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=16,
        host_case=("50%", "75%"),
        host_rows=12,
        main=dict(
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=8,
            floor_scale=4,
            attn_scale=0.5,
            attention_bias=True,
        ),
        fused=dict(
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 1, 1, 1],
            attention_chunk_size=None,
            use_qk_norm=False,
            attn_temperature_tuning=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # Gemma 4 MoE text: a dense GeGLU MLP beside the routed experts in every layer, a router
    # on the residual with per-expert scales, sliding layers (window 5 < every prompt + 32 new
    # tokens) and full layers of another geometry (head_dim 24 vs 16, one KV head, values from
    # the keys, proportional rope), soft-capped logits (cap 3 bites on these logits); hidden 48,
    # head_dim 16 != hidden / heads. Experts are fused on disk already. Fused: three layers,
    # q/k/v/o bias, separate v_proj, other rope thetas and rotated share, top-3, no soft cap.
    "gemma4": Family(
        "gemma4_text",
        dict(
            hidden_size=48,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=24,
            num_global_key_value_heads=1,
            num_experts=8,
            top_k_experts=2,
            enable_moe_block=True,
            hidden_size_per_layer_input=0,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=32,
        host_case=("50%", "75%"),
        host_rows=24,
        main=dict(
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            sliding_window=5,
            attention_k_eq_v=True,
            final_logit_softcapping=3.0,
        ),
        fused=dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=3,
            attention_bias=True,
            top_k_experts=3,
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=500.0),
                full_attention=dict(
                    rope_type="proportional", partial_rotary_factor=0.5, rope_theta=10000.0
                ),
            ),
        ),
    ),
    # Hybrid: Gated DeltaNet linear attention (grouped value heads, dk 8 != dv 12) in layers
    # 0, 2, 3 and gated full attention (partial rotary, q/k norms, output gate) in layer 1;
    # fused in_proj_qkvz / in_proj_ba; sigmoid-gated shared expert; layer 2 dense. Fused: every
    # layer MoE, full attention last (the config's default pattern), no renormalization.
    "qwen3_next": Family(
        "qwen3_next",
        dict(_HYBRID, mlp_only_layers=[2], norm_topk_prob=True),
        routed_experts=24,
        host_case=("50%", "75%"),
        host_rows=18,
        main=dict(
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
            ],
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5
            ),
        ),
        fused=dict(mlp_only_layers=[], norm_topk_prob=False, full_attention_interval=4),
    ),
    # Qwen3.5-MoE text (Qwen3.6-35B-A3B's language model): Qwen3-Next's layers with split
    # in_proj_qkv / z / b / a projections, every layer MoE, renormalized top-k, mrope settings
    # (text positions: plain rope). Fused: the layout the released checkpoints ship.
    "qwen3_5_moe": Family(
        "qwen3_5_moe_text",
        dict(_HYBRID),
        routed_experts=32,
        host_case=("50%", "75%"),
        host_rows=24,
        main=dict(
            layer_types=[
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[1, 1, 0],
                mrope_interleaved=True,
            ),
        ),
        fused=dict(num_experts_per_tok=3),
    ),
    # gpt-oss: every layer MoE, 8 experts top-4, experts fused, transposed and gate/up
    # interleaved on disk with biases and the clamped SwiGLU (its limit, 7, never reached
    # here: tests/models/test_gpt_oss.py clamps with a lower one);
    # attention with sinks and q/k/v/o bias, sliding (window 4 < every prompt + 32 new tokens)
    # and full layers alternating; yarn rope; a biased router. Fused (already fused): top-2,
    # window 3, default rope. MXFP4 experts: tests/models/test_gpt_oss.py.
    "gpt_oss": Family(
        "gpt_oss",
        dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=4,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=24,
        host_case=("50%", "75%"),
        host_rows=18,
        main=dict(
            sliding_window=4,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
        fused=dict(
            num_experts_per_tok=2,
            sliding_window=3,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # DeepSeek-V4: hyper-connected residual streams (2), every layer MoE with a shared expert
    # and clamped SwiGLU (its limit, 10, never reached here: tests/models/test_deepseek_v4.py
    # clamps with a lower one); hash-routed layers 0-1 (tid2eid
    # randomized), sqrtsoftplus top-k with correction bias after; attention over a sliding
    # window (8 < the prompts + 32 new tokens) in layer 0, plus compressed entries: CSA (rate 4,
    # overlapping windows, the indexer keeping 2 per query) in layers 1 and 3, HCA (rate 8) in
    # layer 2; grouped output projection; yarn on the compress rope. Fused: three layers in
    # another order, three streams, sigmoid scores, top-3, one hash layer, default rope.
    "deepseek_v4": Family(
        "deepseek_v4",
        dict(
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            index_n_heads=4,
            index_head_dim=16,
            index_topk=2,
            sliding_window=8,
            hc_mult=2,
            hc_sinkhorn_iters=5,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            vocab_size=256,
            max_position_embeddings=256,
        ),
        routed_experts=32,
        host_case=("50%", "75%"),
        host_rows=24,
        main=dict(
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
        ),
        fused=dict(
            num_hidden_layers=3,
            layer_types=[
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "sliding_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            hc_mult=3,
            scoring_func="sigmoid",
            num_experts_per_tok=3,
        ),
    ),
}

# The smallest Mixtral (2 layers x 4 experts, top-2): exact tier counters and bad-input tests.
MICRO_MIXTRAL = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=32,
)
