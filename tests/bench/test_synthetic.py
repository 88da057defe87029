"""Synthetic shapes: real geometry, and transformers loads the checkpoints moetier reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetier.bench.latency import model_geometry
from moetier.bench.shapes import shape_config
from moetier.bench.synthetic import ensure_synthetic

# (shape, layers, experts, top-k, MB per bf16 expert) as in the facts' table
REAL = [
    ("qwen3-30b-a3b", 48, 128, 8, 9.44),
    ("deepseek-v2-lite", 27, 64, 6, 17.30),
    ("mixtral-8x7b", 32, 8, 2, 352.32),
]


@pytest.mark.parametrize("shape,layers,experts,top_k,mb", REAL)
def test_real_shapes(shape: str, layers: int, experts: int, top_k: int, mb: float) -> None:
    geo = model_geometry(shape_config(shape, layers))
    assert (geo["num_layers"], geo["num_experts"], geo["top_k"]) == (layers, experts, top_k)
    assert 3 * geo["hidden"] * geo["intermediate"] * 2 / 1e6 == pytest.approx(mb, abs=0.01)


def test_deepseek_v2_lite_details() -> None:
    c = shape_config("deepseek-v2-lite", 27)
    assert (c.first_k_dense_replace, c.n_shared_experts, c.kv_lora_rank, c.q_lora_rank) == (
        1,
        2,
        512,
        None,
    )
    assert (c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.vocab_size) == (
        64,
        128,
        128,
        102400,
    )


TINY = ["tiny-qwen3", "tiny-deepseek-v2", "tiny-mixtral"]
TINY_2026 = ["tiny-qwen3.5-moe", "tiny-gemma4", "tiny-glm4-moe", "tiny-deepseek-v4"]


@pytest.mark.parametrize("shape", TINY + TINY_2026)
def test_transformers_and_moetier_agree(shape: str) -> None:
    from transformers import AutoModelForCausalLM

    from moetier import LLM, SamplingParams

    path = ensure_synthetic(shape, None, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = [5, 77, 301, 9, 42, 7]
    with torch.inference_mode():
        out = hf.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    llm = LLM(str(path), expert_budget="50%", progress=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == out[0, 6:].tolist()


@pytest.mark.parametrize(
    "shape,experts_at,moe_layers",
    [
        ("tiny-qwen3.5-moe", "model.layers.{}.mlp.experts", [0, 1, 2, 3]),
        ("tiny-gemma4", "model.layers.{}.experts", [0, 1, 2, 3, 4, 5]),
        ("tiny-glm4-moe", "model.layers.{}.mlp.experts", [1, 2]),
    ],
)
def test_2026_tiny_shapes_run_in_moetier(
    shape: str, experts_at: str, moe_layers: list[int]
) -> None:
    """The fused experts sit where the family's loader reads them, every MoE layer's 16 experts
    are tiered, and greedy tokens at 25 % of the experts equal those with all resident."""
    import json

    from moetier import LLM, SamplingParams

    path = ensure_synthetic(shape, None, seed=1)
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    fused = {n.rsplit(".", 1)[0] for n in names if n.endswith("experts.gate_up_proj")}
    assert fused == {experts_at.format(i) for i in moe_layers}
    assert ("lm_head.weight" in names) == (shape != "tiny-gemma4")  # Gemma 4's head is tied
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for budget in (None, "25%"):
        llm = LLM(str(path), expert_budget=budget, device="cpu", progress=False)
        stats = llm.offload_stats()
        assert stats["total_experts"] == 16 * len(moe_layers)
        assert stats["expert_bytes"] == 3 * 64 * 32 * 4  # hidden 64, intermediate 32, float32
        tokens.append(llm.generate([[5, 77, 301, 9, 42, 7]], params)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


# The 2026 families' published sizes (synthetic.py says where each comes from): (shape, layers,
# MoE layers, experts, top-k, hidden D, expert intermediate I).
FAMILIES_2026 = [
    ("qwen3.6-35b-a3b", 40, 40, 256, 8, 2048, 512),
    ("gemma-4-26b-a4b", 30, 30, 128, 8, 2816, 704),
    ("glm-4.5-air", 46, 45, 128, 8, 4096, 1408),
    ("deepseek-v4-flash", 43, 43, 256, 6, 4096, 2048),
]


@pytest.mark.parametrize("shape,layers,moe_layers,experts,top_k,d,i", FAMILIES_2026)
def test_2026_shapes_have_the_published_sizes(
    shape: str, layers: int, moe_layers: int, experts: int, top_k: int, d: int, i: int
) -> None:
    """Experts, top-k and depth of the config the writer builds, and the routed experts'
    tensors it writes: fused [E, 2I, D] + [E, D, I], 3 * D * I bf16 values an expert."""
    from moetier.bench.shapes import DEFAULT_LAYERS
    from moetier.bench.synthetic import checkpoint_plan

    c = shape_config(shape, DEFAULT_LAYERS[shape])
    e = getattr(c, "num_experts", None) or c.n_routed_experts
    k = getattr(c, "top_k_experts", None) or c.num_experts_per_tok
    assert (c.num_hidden_layers, e, k) == (layers, experts, top_k)
    assert (c.hidden_size, c.moe_intermediate_size) == (d, i)
    _, plan = checkpoint_plan(c)
    gate_up = {n: s for n, s in plan.items() if n.endswith("experts.gate_up_proj")}
    down = {n: s for n, s in plan.items() if n.endswith("experts.down_proj")}
    assert len(gate_up) == len(down) == moe_layers
    assert set(gate_up.values()) == {torch.Size([experts, 2 * i, d])}
    assert set(down.values()) == {torch.Size([experts, d, i])}
    per_expert = sum(s.numel() for s in [*gate_up.values(), *down.values()]) // (
        moe_layers * experts
    )
    assert per_expert * 2 == 3 * d * i * 2


# bf16 bytes of one routed expert and of all of them (MoE layers x experts x bytes), as the
# products of the published dimensions.
ROUTED_BF16 = [
    ("qwen3.6-35b-a3b", 6_291_456, 64_424_509_440),
    ("gemma-4-26b-a4b", 11_894_784, 45_675_970_560),
    ("glm-4.5-air", 34_603_008, 199_313_326_080),
    ("deepseek-v4-flash", 50_331_648, 554_050_781_184),
]


@pytest.mark.parametrize("shape,expert_bytes,routed_bytes", ROUTED_BF16)
def test_2026_shapes_routed_bytes(shape: str, expert_bytes: int, routed_bytes: int) -> None:
    from moetier.bench.shapes import DEFAULT_LAYERS

    row = next(r for r in FAMILIES_2026 if r[0] == shape)
    _, _, moe_layers, experts, _, d, i = row
    assert expert_bytes == 3 * d * i * 2
    assert routed_bytes == moe_layers * experts * expert_bytes
    # what `bench latency` and `bench serve` count a miss as (bf16 on the GPU)
    geo = model_geometry(shape_config(shape, DEFAULT_LAYERS[shape]))
    assert (geo["num_experts"], geo["top_k"]) == (experts, row[4])
    assert 3 * geo["hidden"] * geo["intermediate"] * 2 == expert_bytes


def test_2026_shape_details() -> None:
    """What distinguishes each family's layers, at the released sizes."""
    q = shape_config("qwen3.6-35b-a3b", 40)
    full = [n for n, t in enumerate(q.layer_types) if t == "full_attention"]
    assert full == list(range(3, 40, 4))
    linear = (q.linear_num_key_heads, q.linear_num_value_heads, q.linear_key_head_dim)
    assert linear == (16, 32, 128) and q.linear_value_head_dim == 128
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (16, 2, 256)
    assert (q.shared_expert_intermediate_size, q.vocab_size) == (512, 248320)
    assert q.rope_parameters["mrope_section"] == [11, 11, 10]
    g = shape_config("gemma-4-26b-a4b", 30)
    assert [n for n, t in enumerate(g.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    local, glob = g.per_layer_config[0], g.per_layer_config[5]  # sliding, full
    assert (local.head_dim, local.num_key_value_heads, g.num_attention_heads) == (256, 8, 16)
    assert (glob.head_dim, glob.num_key_value_heads, g.attention_k_eq_v) == (512, 2, True)
    assert (g.intermediate_size, g.sliding_window) == (2112, 1024)
    assert (g.hidden_activation, g.final_logit_softcapping, g.vocab_size) == (
        "gelu_pytorch_tanh",
        30.0,
        262144,
    )
    assert g.enable_moe_block and not g.hidden_size_per_layer_input and g.tie_word_embeddings
    a = shape_config("glm-4.5-air", 46)
    assert (a.first_k_dense_replace, a.n_shared_experts, a.intermediate_size) == (1, 1, 10944)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (96, 8, 128)
    assert (a.attention_bias, a.vocab_size) == (True, 151552)


def test_deepseek_v4_flash_details() -> None:
    """The released schedule and sizes, and the tensors the writer plans under the names
    save_pretrained gives them, with the released checkpoint's shapes (its shard headers)."""
    from moetier.bench.synthetic import checkpoint_plan

    c = shape_config("deepseek-v4-flash", 43)
    kinds = [t.split("_")[0] for t in c.layer_types]  # sliding / compressed / heavily
    assert kinds[:2] == ["sliding"] * 2 and c.layer_types[42] == "compressed_sparse_attention"
    assert kinds[2:] == ["compressed", "heavily"] * 20 + ["compressed"]
    assert c.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 40
    assert c.compress_rates == {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 128,
    }
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qk_rope_head_dim) == (
        64,
        1,
        512,
        64,
    )
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.n_shared_experts) == (1024, 8, 1024, 1)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.sliding_window, c.swiglu_limit) == (4, 20, 128, 10.0)
    assert (c.scoring_func, c.routed_scaling_factor, c.vocab_size) == ("sqrtsoftplus", 1.5, 129280)
    compress = c.rope_parameters["compress"]
    assert (compress["rope_type"], compress["factor"], compress["rope_theta"]) == (
        "yarn",
        16.0,
        160000.0,
    )
    assert c.rope_parameters["main"]["rope_theta"] == 10000.0 and not c.tie_word_embeddings
    _, plan = checkpoint_plan(shape_config("deepseek-v4-flash", 2))
    released = {
        "model.layers.0.attn.wq_a.weight": (1024, 4096),
        "model.layers.0.attn.wq_b.weight": (32768, 1024),
        "model.layers.0.attn.wkv.weight": (512, 4096),
        "model.layers.0.attn.wo_a.weight": (8192, 4096),
        "model.layers.0.attn.wo_b.weight": (4096, 8192),
        "model.layers.0.ffn.gate.weight": (256, 4096),
        "model.layers.0.ffn.gate.tid2eid": (129280, 6),
        "model.layers.0.ffn.shared_experts.w1.weight": (2048, 4096),
        "model.layers.0.hc_attn_fn": (24, 16384),
        "model.layers.0.hc_attn_base": (24,),
        "model.layers.1.ffn.experts.gate_up_proj": (256, 4096, 4096),
        "head.weight": (129280, 4096),
    }
    assert {n: tuple(plan[n]) for n in released} == released
    assert not any(".mlp." in n or ".self_attn." in n for n in plan)


def test_tiny_deepseek_v4_is_written_as_transformers_saves_it() -> None:
    """Tensor names as save_pretrained writes them (experts fused), K distinct experts per
    token id in each hash layer's table, every layer's experts tiered, and greedy tokens at 25 %
    of the experts equal those with all resident."""
    import json

    from safetensors import safe_open

    from moetier import LLM, SamplingParams

    path = ensure_synthetic("tiny-deepseek-v4", None, seed=1)
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    fused = {n.rsplit(".", 1)[0] for n in names if n.endswith("experts.gate_up_proj")}
    assert fused == {f"model.layers.{i}.ffn.experts" for i in range(4)}
    assert {"head.weight", "model.layers.2.attn.indexer.wq_b.weight"} <= set(names)
    assert {"model.layers.3.ffn.gate.bias", "model.layers.3.hc_ffn_fn"} <= set(names)
    tables = [n for n in names if n.endswith("tid2eid")]
    assert tables == [f"model.layers.{i}.ffn.gate.tid2eid" for i in range(3)]
    with safe_open(str(path / names[tables[0]]), "pt") as f:
        table = f.get_tensor(tables[0])
    assert table.dtype == torch.int64 and table.shape == (512, 4)
    assert int(table.min()) >= 0 and int(table.max()) < 16
    assert all(len(set(row)) == 4 for row in table.tolist())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for budget in (None, "25%"):
        llm = LLM(str(path), expert_budget=budget, device="cpu", progress=False)
        stats = llm.offload_stats()
        assert stats["total_experts"] == 16 * 4 and stats["expert_bytes"] == 3 * 64 * 32 * 4
        tokens.append(llm.generate([[5, 77, 301, 9, 42, 7]], params)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_fp8_synthetic_is_read_as_stored() -> None:
    from moetier import LLM, SamplingParams
    from moetier.weights.checkpoint import Checkpoint

    path = ensure_synthetic("tiny-qwen3", None, seed=1, fmt="fp8")
    assert path.name.endswith("-fp8")
    ckpt = Checkpoint(path)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert ckpt.info(name).dtype == torch.float8_e4m3fn and ckpt.info(name).shape == (64, 32)
    assert ckpt.info(name + "_scale_inv").shape == (1, 1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 77, 301, 9, 42, 7]
    tokens = []
    for budget in (None, "25%"):
        llm = LLM(str(path), expert_budget=budget, progress=False)
        stats = llm.offload_stats()
        # per matrix: 32 x 64 e4m3 bytes, then one float32 scale, each part 16-byte aligned
        assert stats["expert_format"] == "fp8_e4m3" and stats["expert_bytes"] == 3 * 2064
        tokens.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


@pytest.mark.parametrize(
    "shape,experts,layers", [("gpt-oss-20b", 32, 24), ("gpt-oss-120b", 128, 36)]
)
def test_gpt_oss_shapes(shape: str, experts: int, layers: int) -> None:
    from moetier.bench.shapes import DEFAULT_LAYERS, MXFP4_SHAPES

    c = shape_config(shape, DEFAULT_LAYERS[shape])
    assert (c.num_hidden_layers, c.num_local_experts, c.num_experts_per_tok) == (layers, experts, 4)
    assert (c.hidden_size, c.intermediate_size, c.head_dim, c.sliding_window) == (
        2880,
        2880,
        64,
        128,
    )
    assert c.layer_types[:2] == ["sliding_attention", "full_attention"] and shape in MXFP4_SHAPES


def test_tiny_gpt_oss_is_mxfp4_and_transformers_agrees() -> None:
    # The synthetic MXFP4 checkpoint is read as stored (17/32 byte per weight) and generates
    # transformers' tokens (its MXFP4 CPU path: dequantize on load).
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from moetier import LLM, SamplingParams

    path = ensure_synthetic("tiny-gpt-oss", None, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    prompt = [5, 77, 301, 9, 42, 7]
    with torch.inference_mode():
        out = hf.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    llm = LLM(str(path), expert_budget="50%", dtype="float32", progress=False)
    packing = llm.engine.runner.expert_cache.packing
    assert packing.name == "mxfp4" and packing.nbytes == 3 * 64 * 32 * 17 // 32
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == out[0, 6:].tolist()


@pytest.mark.parametrize("fmt", ["gguf-q4_k_m", "gguf-q8_0"])
def test_gguf_synthetic_runs_as_stored(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench synthetic --format gguf-*`: one .gguf file whose experts are read in their block
    types; greedy tokens at 25% of the expert bytes equal those with every expert resident."""
    from moetier import LLM, SamplingParams
    from moetier.bench.latency import _synthetic_meta
    from moetier.weights.gguf import open_gguf

    monkeypatch.setenv("MOETIER_HOME", str(tmp_path))
    shape = "tiny-qwen3-k" if fmt == "gguf-q4_k_m" else "tiny-qwen3"
    path = ensure_synthetic(shape, None, seed=1, fmt=fmt)
    assert path.name == "model.gguf" and path.parent.name.endswith(f"-{fmt}")
    assert ensure_synthetic(shape, None, seed=1, fmt=fmt) == path  # cached
    meta = _synthetic_meta(path)
    assert meta is not None and meta["format"] == fmt
    config, _, layout = open_gguf(path)
    d, i = (256, 256) if fmt == "gguf-q4_k_m" else (64, 32)
    assert (config.hidden_size, config.moe_intermediate_size, layout.layers) == (d, i, [0, 1])
    # gate/up Q4_K (144 bytes per 256 values), down Q6_K (210); Q8_0: 34 bytes per 32
    want = (
        2 * i * d // 256 * 144 + d * i // 256 * 210
        if fmt == "gguf-q4_k_m"
        else 3 * 34 * i * d // 32
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 77, 301, 9, 42, 7]
    tokens = []
    for budget in (None, "25%"):
        llm = LLM(str(path), expert_budget=budget, device="cpu", progress=False)
        stats = llm.offload_stats()
        assert stats["expert_bytes"] == -(-want // 16) * 16
        tokens.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_synthetic_rejects_formats_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moetier.errors import ConfigError

    monkeypatch.setenv("MOETIER_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="tiny-qwen3 in gguf-q4_k.*blocks of 256"):
        ensure_synthetic("tiny-qwen3", None, seed=1, fmt="gguf-q4_k")
    with pytest.raises(ConfigError, match="deepseek_v2.*no GGUF writer"):
        ensure_synthetic("tiny-deepseek-v2", None, seed=1, fmt="gguf-q8_0")
    with pytest.raises(ConfigError, match="tiny-deepseek-v4 in fp8.*--format bf16"):
        ensure_synthetic("tiny-deepseek-v4", None, seed=1, fmt="fp8")


def test_bench_latency_on_a_gguf_synthetic(tmp_path: Path) -> None:
    """`moetier bench latency --synthetic S --format gguf-q4_k_m` reads the file's config and
    times a miss's pread of the expert's stored bytes (Q4_K_M: 2 x 256 x 144 + 256 x 210)."""
    import json

    from moetier.cli import main

    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--synthetic", "tiny-qwen3-k", "--format", "gguf-q4_k_m"]
    args += ["--expert-budget", "50%", "--input-len", "8", "--output-len", "4", "--device", "cpu"]
    assert main([*args, "--num-prompts", "1", "--no-progress", "--save-result", str(out)]) == 0
    result = json.loads(out.read_text())
    meta = result["settings"]["synthetic_meta"]
    assert meta["format"] == "gguf-q4_k_m" and meta["shape"] == "tiny-qwen3-k"
    assert result["link"]["link_bytes_per_miss"] == 2 * 256 * 144 + 256 * 210
