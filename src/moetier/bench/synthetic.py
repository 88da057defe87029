"""Synthetic checkpoints with real MoE shapes (random bf16 weights), cached, and a decode bench.

Owns the shape table, the seeded weight fill and the on-disk cache of generated checkpoints
(`$MOETIER_HOME/synthetic/<shape>-L<layers>-s<seed>/`, reused once its marker file exists); it
does not measure anything beyond the small legacy decode benchmark at the bottom.

The gpt-oss shapes store their experts in MXFP4 as the released checkpoints do (random block
bytes, scales that give bf16-like magnitudes; `quantization_config.quant_method: mxfp4`).
Multimodal releases (Qwen3.6, Gemma 4) are written as their text model alone, the CausalLM
class moetier loads (`Qwen3_5MoeForCausalLM`, `Gemma4ForCausalLM`): same layers and tensor
shapes, without the `model.language_model.` prefix and the vision tower.

Random weights give near-random routing: results measure the transfer path under uniform
expert demand, not real-text locality. Say so beside any number this produces. Deep random
stacks route degenerately (the hidden state stops depending on the token): use the bench's
routing override (`--routing uniform` or `trace:PATH`) on them.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import queue
import shutil
import statistics
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

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

# name: HF config of the shape (without num_hidden_layers); DEFAULT_LAYERS gives the real depth.
SHAPES: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": dict(_GPT_OSS, num_local_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_local_experts=128),
    "qwen3-30b-a3b": _QWEN3_30B,
    "qwen3.6-35b-a3b": _QWEN3_6_35B,
    "gemma-4-26b-a4b": _GEMMA4_26B,
    "glm-4.5-air": _GLM45_AIR,
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
}
MARKER = "synthetic-complete.json"
# Multiplicative scales filled with ones, as HF initializes them (Gemma 4's per-layer output
# scalar and router scales): random ones would flip signs and compound over the layers.
_ONES = (".layer_scalar", ".router.scale", ".router.per_expert_scale")
_CPU_POOL = 1_000_003  # prime: tiled pool slices never align with expert or row boundaries


def moetier_home() -> Path:
    """$MOETIER_HOME, else ~/.cache/moetier."""
    return Path(os.environ.get("MOETIER_HOME") or Path.home() / ".cache" / "moetier")


# Expert storage formats a synthetic checkpoint can be written in (`--format`). gguf-*: one
# GGUF file (`model.gguf`) with experts as random valid blocks of that type (q4_k_m: gate and
# up Q4_K, down Q6_K) and the other weights F16.
GGUF_FORMATS: dict[str, tuple[str, str, str]] = {
    "gguf-q4_k": ("gguf-q4_k",) * 3,
    "gguf-q4_k_m": ("gguf-q4_k", "gguf-q4_k", "gguf-q6_k"),
    "gguf-q6_k": ("gguf-q6_k",) * 3,
    "gguf-q8_0": ("gguf-q8_0",) * 3,
}
FORMATS = ("bf16", "fp8", *GGUF_FORMATS)
GGUF_FILE = "model.gguf"
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def synthetic_dir(shape: str, num_layers: int, seed: int, fmt: str = "bf16") -> Path:
    suffix = "" if fmt == "bf16" else f"-{fmt}"
    return moetier_home() / "synthetic" / f"{shape}-L{num_layers}-s{seed}{suffix}"


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


def checkpoint_plan(config: Any) -> tuple[str, dict[str, torch.Size]]:
    """(CausalLM class name, {tensor name: shape}) of the bf16 checkpoint `write_synthetic`
    writes for `config`: the transformers model's state dict, built on the meta device (routed
    experts fused: `experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]). A tied LM
    head is left out, as save_pretrained leaves it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    plan = {
        name: p.shape
        for name, p in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    return type(model).__name__, plan


def _mxfp4_experts(filler: _Filler, name: str, shape: torch.Size) -> dict[str, torch.Tensor]:
    """HF's float expert tensor `name` [E, cols, rows] as MXFP4 blocks [E, rows, cols/32, 16]
    + scales [E, rows, cols/32]: random nibbles, one scale for the whole tensor putting the
    values' RMS near 1/sqrt(cols) (random FP4 nibbles have an RMS of 2.93 units)."""
    import math

    e, cols, rows = shape
    gen = filler._gen(name)
    size = (e, rows, cols // 32, 16)
    blocks = torch.randint(0, 256, size, dtype=torch.uint8, generator=gen, device=filler.device)
    blocks = blocks.cpu()
    exp = round(math.log2(1.0 / (2.93 * math.sqrt(cols))))
    scales = torch.full((e, rows, cols // 32), 127 + exp, dtype=torch.uint8)
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


class _Filler:
    """Seeded bf16 weights; each tensor's values depend only on (seed, name, fill device).

    CUDA: `torch.randn` with a CUDA generator (fast). CPU: small tensors get `randn`; large ones
    are tiled from one seeded random pool at a per-tensor offset (CPU `randn` is single-threaded
    and takes minutes at real sizes; the tiling costs a memcpy). The same seed gives different
    weights on the two fill devices.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device
        self._pool: torch.Tensor | None = None

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(
            self.seed * 1_000_003 + zlib.crc32(name.encode())
        )

    def __call__(self, name: str, shape: torch.Size) -> torch.Tensor:
        if "norm" in name or name.endswith(_ONES):
            return torch.ones(shape, dtype=torch.bfloat16)
        scale = 1.0 / max(shape[-1] if len(shape) else 1, 1) ** 0.5
        numel = shape.numel()
        gen = self._gen(name)
        if self.device.type == "cuda":
            t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)
            return t.mul_(scale).cpu()
        if numel <= 1 << 20:
            return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
        if self._pool is None:
            pool_gen = torch.Generator().manual_seed(self.seed)
            self._pool = torch.randn(_CPU_POOL, generator=pool_gen).to(torch.bfloat16)
        offset = int(torch.randint(_CPU_POOL, (1,), generator=gen))
        reps = (numel + offset) // _CPU_POOL + 1
        flat = self._pool.repeat(reps)[offset : offset + numel]
        return flat.view(shape).mul_(scale)


def _shard_of(name: str) -> str:
    return (
        f"layer-{int(name.split('.')[2]):03d}.safetensors"
        if ".layers." in name
        else ("rest.safetensors")
    )


def write_synthetic(
    path: Path,
    shape: str,
    num_layers: int,
    seed: int = 0,
    device: str | None = None,
    fmt: str = "bf16",
) -> Path:
    """Write a `num_layers`-layer checkpoint of `shape` to `path`, one shard per layer.

    bf16: experts are stored fused (`experts.gate_up_proj`, `experts.down_proj`) as
    transformers saves them; the MXFP4 shapes (gpt-oss) store `*_blocks` + `*_scales` instead.
    fp8: per expert in e4m3 with 128x128 block scales (`weight_scale_inv`), the layout of
    Qwen3-*-FP8 and DeepSeek-V3 (other weights bf16). gguf-*: one GGUF file in `path`
    (`write_synthetic_gguf`), whose path is returned. `device`: where to fill (default CUDA
    when available). A writer thread saves one shard while the next is filled, so a GPU fill
    runs at disk speed.
    """
    if fmt not in FORMATS:
        from moetier.errors import ConfigError

        raise ConfigError(f"unknown synthetic format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt in GGUF_FORMATS:
        path.mkdir(parents=True, exist_ok=True)
        return write_synthetic_gguf(path / GGUF_FILE, shape, num_layers, seed, device, fmt)
    config = shape_config(shape, num_layers)
    architecture, plan = checkpoint_plan(config)
    config.architectures = [architecture]
    if fmt == "fp8":
        config.quantization_config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    fill_dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    filler = _Filler(seed, fill_dev)
    mxfp4 = shape in MXFP4_SHAPES
    if mxfp4:
        config.quantization_config = MXFP4_QUANTIZATION
        config.save_pretrained(path)

    def tensors(name: str, shape: torch.Size) -> dict[str, torch.Tensor]:
        if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return _mxfp4_experts(filler, name, shape)
        return {name: filler(name, shape).contiguous()}

    groups: dict[str, dict[str, torch.Size]] = {}
    for name, size in plan.items():
        groups.setdefault(_shard_of(name), {})[name] = size
    done: queue.Queue[tuple[str, dict[str, torch.Tensor]] | None] = queue.Queue(maxsize=1)
    errors: list[BaseException] = []

    def writer() -> None:
        while (item := done.get()) is not None:
            try:
                save_file(item[1], str(path / item[0]), metadata={"format": "pt"})
            except BaseException as exc:  # reported by the caller below
                errors.append(exc)

    weight_names: dict[str, list[str]] = {}
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for shard, names in groups.items():
            shard_tensors: dict[str, torch.Tensor] = {}
            for n, s in names.items():
                shard_tensors.update(tensors(n, s))
            if fmt == "fp8":
                shard_tensors = _fp8_experts(shard_tensors, fill_dev)
            weight_names[shard] = list(shard_tensors)
            done.put((shard, shard_tensors))
    finally:
        done.put(None)
        thread.join()
    if errors:
        raise errors[0]
    weight_map = {n: shard for shard, names in weight_names.items() for n in names}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _fp8_experts(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Fused bf16 experts of one shard -> per-expert e4m3 + float32 128x128 block scales. One
    scale for every block (the weights are random: a per-block amax would buy nothing), chosen
    so the values span e4m3's range without saturating (|w| / scale <= ~7 sigma x 64)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = t
            continue
        t = t.to(device)
        scale = 1.0 / (64 * t.shape[-1] ** 0.5)
        parts = [("gate_proj", "up_proj"), ("down_proj",)][name.endswith("down_proj")]
        for e in range(t.shape[0]):
            for j, part in enumerate(parts):
                rows = t.shape[1] // len(parts)
                w = t[e, j * rows : (j + 1) * rows]
                key = f"{base}.{e}.{part}.weight"
                out[key] = (w.float() / scale).to(torch.float8_e4m3fn).cpu()
                blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
                out[key + "_scale_inv"] = torch.full(blocks, scale, dtype=torch.float32)
    return out


def write_synthetic_gguf(
    file: Path,
    shape: str,
    num_layers: int,
    seed: int = 0,
    device: str | None = None,
    fmt: str = "gguf-q4_k_m",
) -> Path:
    """Write `shape` as one GGUF file: experts (`blk.N.ffn_{gate,up,down}_exps`) as random
    valid blocks of the format's types (no float matrix is quantized: the gguf package has no K
    quantizer, and random weights would gain nothing from one), other weights F16 from the
    seeded filler, norms F32 ones. Tensors stream to the file one by one (never all in RAM)."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    from moetier.errors import ConfigError
    from moetier.weights.formats import get_codec
    from moetier.weights.gguf_quants import GGUFCodec, random_blocks

    config = shape_config(shape, num_layers)
    arch = _GGUF_ARCH.get(config.model_type)
    if arch is None:
        raise ConfigError(
            f"synthetic shape {shape!r} ({config.model_type}) has no GGUF writer; GGUF formats "
            f"are written for {', '.join(sorted(_GGUF_ARCH))} shapes"
        )
    codecs: list[GGUFCodec] = []
    for codec_name in GGUF_FORMATS[fmt]:
        codec = get_codec(codec_name)
        assert isinstance(codec, GGUFCodec)
        codecs.append(codec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = gguf.get_tensor_name_map(
        {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "llama": gguf.MODEL_ARCH.LLAMA}[arch], num_layers
    )
    # (GGUF name, fill key, torch shape [.., rows, cols], codec or None = F16 / F32 norms)
    plan: list[tuple[str, str, tuple[int, ...], Any]] = []
    for name, p in model.state_dict().items():
        if ".experts." in name:
            layer = name.split(".")[2]
            e, rows, cols = p.shape
            if name.endswith("gate_up_proj"):
                plan.append((f"blk.{layer}.ffn_gate_exps.weight", name, (e, rows // 2, cols), 0))
                plan.append((f"blk.{layer}.ffn_up_exps.weight", name, (e, rows // 2, cols), 1))
            else:
                plan.append((f"blk.{layer}.ffn_down_exps.weight", name, (e, rows, cols), 2))
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ConfigError(f"synthetic {shape}: no GGUF name for {name}")
        plan.append((f"{gguf_name}.{suffix}", name, tuple(p.shape), None))
    for gguf_name, _, dims, k in plan:
        if k is not None:
            try:
                codecs[k].nbytes(dims[1], dims[2])
            except ValueError as exc:
                raise ConfigError(f"synthetic {shape} in {fmt}: {gguf_name}: {exc}") from None
    w = gguf.GGUFWriter(str(file), arch)
    _gguf_metadata(w, arch, config, shape)
    for gguf_name, _, dims, k in plan:
        if k is None:
            dtype = np.float32 if "norm" in gguf_name else np.float16
            nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
            w.add_tensor_info(gguf_name, dims, np.dtype(dtype), nbytes)
        else:
            c = codecs[k]
            nbytes = dims[0] * c.nbytes(dims[1], dims[2])
            byte_shape = (dims[0], dims[1], nbytes // dims[0] // dims[1])
            w.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), nbytes, c.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    filler = _Filler(seed, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    for gguf_name, key, dims, k in plan:
        if k is None:
            t = filler(key, torch.Size(dims)).float()
            w.write_tensor_data(t.numpy().astype(np.float32 if "norm" in gguf_name else np.float16))
            continue
        c = codecs[k]
        e, rows, cols = dims
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(gguf_name.encode()))
        blocks = random_blocks(c, e * rows, cols, 2.0 / cols**0.5, gen)
        w.write_tensor_data(blocks.numpy().reshape(e, rows, -1))
    w.close()
    return file


def _gguf_metadata(w: Any, arch: str, config: Any, shape: str) -> None:
    """llama.cpp's metadata keys for the config (what weights/gguf.py reads back)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_name(f"synthetic-{shape}")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_vocab_size(config.vocab_size)
    w.add_feed_forward_length(config.intermediate_size)
    if arch == "llama":
        w.add_expert_count(config.num_local_experts)
    else:
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)


def ensure_synthetic(
    shape: str,
    num_layers: int | None = None,
    seed: int = 0,
    device: str | None = None,
    fmt: str = "bf16",
) -> Path:
    """The cached checkpoint of (shape, layers, seed, format); generated first when missing or
    partial. The marker file is written last, so an interrupted write is detected and redone.
    A GGUF format gives the .gguf file (in that directory, beside the marker).
    """
    layers = num_layers or DEFAULT_LAYERS.get(shape, 4)
    path = synthetic_dir(shape, layers, seed, fmt)
    if (path / MARKER).exists():
        return path / GGUF_FILE if fmt in GGUF_FORMATS else path
    if path.exists():
        log.warning("removing incomplete synthetic checkpoint %s", path)
        shutil.rmtree(path)
    t0 = time.perf_counter()
    written = write_synthetic(path, shape, layers, seed, device, fmt)
    fill = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta = dict(
        shape=shape,
        layers=layers,
        seed=seed,
        format=fmt,
        fill_device=fill,
        write_s=round(time.perf_counter() - t0, 2),
    )
    (path / MARKER).write_text(json.dumps(meta) + "\n")
    log.info("wrote synthetic %s in %.1f s", path, meta["write_s"])
    return written


def decode_benchmark(
    path: Path,
    budget: str | None,
    prompt_len: int = 64,
    new_tokens: int = 64,
    device: str = "auto",
    dtype: str = "auto",
    moe_grouped_kernel: bool | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """TTFT and TPOT at batch 1 for one expert budget, with offload counters per token."""
    from moetier import LLM, SamplingParams

    llm = LLM(
        str(path),
        expert_budget=budget,
        device=device,
        dtype=dtype,
        progress=False,
        moe_grouped_kernel=moe_grouped_kernel,
        enable_prefix_caching=False,  # the timed prompt is the warm-up's: prefill it again
    )
    prompt = [(7 * i + 3) % 31000 + 1 for i in range(prompt_len)]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], warm)
    llm.engine.runner.stats.reset()
    engine = llm.engine
    # Sampled at temperature 1 so tokens (and routing) vary: greedy decoding of random weights
    # tends to repeat one token, which would make every step reuse the same experts.
    engine.add_request(
        prompt,
        SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed, ignore_eos=True),
    )
    times = []
    sync = torch.cuda.synchronize if llm.engine.runner.device.type == "cuda" else (lambda: None)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    s = llm.offload_stats()
    decode = times[1:]
    return {
        "budget": budget or "100%",
        "moe_compute": "loop" if moe_grouped_kernel is False else "default",
        "device_slots": s["device_slots"],
        "total_experts": s["total_experts"],
        "ttft_ms": times[0] * 1e3,
        "tpot_ms_median": statistics.median(decode) * 1e3,
        "tpot_ms_p99": sorted(decode)[int(0.99 * (len(decode) - 1))] * 1e3,
        "exposed_fetch_ms_per_token": s["exposed_fetch_s"] * 1e3 / len(times),
        "host_to_device_MB_per_token": s["bytes_host_to_device"] / 1e6 / len(times),
        "device_hit_rate": s["device_hit_rate"],
    }


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="decode benchmark on a synthetic real-shape MoE")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budgets", default="100%,50%,25%,10%")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seeds the weights and the sampling")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    ap.add_argument(
        "--compare-loop",
        action="store_true",
        help="also run each budget with the per-expert loop (grouped kernel off)",
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_synthetic(Path(tmp) / args.shape, args.shape, args.layers, args.seed)
        variants: list[bool | None] = [False, None] if args.compare_loop else [None]
        rows = [
            decode_benchmark(
                path,
                None if b == "100%" else b,
                args.prompt_len,
                args.new_tokens,
                moe_grouped_kernel=v,
                seed=args.seed,
            )
            for b in args.budgets.split(",")
            for v in variants
        ]
    result = {
        "shape": args.shape,
        "layers": args.layers,
        "weights": "random bf16 (near-random routing)",
        "seed": args.seed,
        "decode": f"sampled, temperature 1.0, seed {args.seed}",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch": 1,
        "torch": torch.__version__,
        "write_s": time.perf_counter() - t0,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
