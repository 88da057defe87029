"""Gemma 4 MoE text (`gemma4`) GGUF files run directly: greedy tokens and logits equal
transformers, the config and every tensor llama.cpp's converter renamed or fused read back as
the HF model holds them, missing metadata keys are named.

transformers' GGUF load reads no gemma4 model (its config step fails on the per-layer KV
heads), so the reference is the HF model holding gguf's dequantization of the bytes written, as
for gpt-oss and GLM / DeepSeek (tests/models/gguf_gemma4_files.py writes the files).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moetier.errors import CheckpointError
from moetier.weights.gguf import open_gguf
from tests.models.gguf_files import check_file_parity, reference_model, slot_bytes
from tests.models.gguf_gemma4_files import GEMMA4_K, tiny_gemma4_model, write_gemma4_gguf

# name -> (experts' types: fused gate_up, down; non-expert matrices' type; model overrides)
# Q8_0 everywhere at D 64 / I 32; Q4_K_M's (gate_up Q4_K, down Q6_K) at D = I = 256, F32 rest
CASES: dict[str, tuple[tuple[T, T], T, dict[str, Any]]] = {
    "gemma4-q8_0": ((T.Q8_0, T.Q8_0), T.Q8_0, {}),
    "gemma4-q4_k_m": ((T.Q4_K, T.Q6_K), T.F32, GEMMA4_K),
}
TOP_K = 2


@pytest.fixture(scope="module")
def gemma4_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """name -> (file, reference model, the HF model it was written from), written on first use."""
    root = tmp_path_factory.mktemp("gguf_gemma4")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> tuple[Path, Any, Any]:
            experts, dense, overrides = CASES[name]
            path = root / f"{name}.gguf"
            model = tiny_gemma4_model(**overrides)
            state = write_gemma4_gguf(model, path, experts, dense)
            self[name] = (path, reference_model(model, state), tiny_gemma4_model(**overrides))
            return self[name]

    return Lazy()


@pytest.mark.parametrize(
    "name,budget",
    [pytest.param(n, b, id=f"{n}-{b}") for n in CASES for b in ("100%", "min")],
)
def test_gemma4_gguf_parity(gemma4_files: Any, name: str, budget: str) -> None:
    path, ref, original = gemma4_files[name]
    (gate_up, down), _, _ = CASES[name]
    if budget == "min":
        d, i = original.config.hidden_size, original.config.moe_intermediate_size
        budget = f"{TOP_K * slot_bytes((gate_up, gate_up, down), d, i)}B"
    check_file_parity(path, ref, budget, TOP_K, name)


def _check_config(config: Any, want: Any) -> None:
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "attention_k_eq_v", "layer_types",
        "sliding_window", "rope_parameters", "max_position_embeddings", "num_experts",
        "top_k_experts", "enable_moe_block", "hidden_activation", "attention_bias",
        "hidden_size_per_layer_input", "num_kv_shared_layers", "tie_word_embeddings",
        "final_logit_softcapping", "model_type",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(want, key), key
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # stored as float32
    assert config.architectures == ["Gemma4ForCausalLM"]
    for layer in range(want.num_hidden_layers):  # head sizes and KV heads per layer type
        got, exp = config.per_layer_config[layer], want.per_layer_config[layer]
        assert (got.head_dim, got.num_key_value_heads) == (exp.head_dim, exp.num_key_value_heads)


def test_gemma4_gguf_config_and_converter_inverses(gemma4_files: Any, tmp_path: Path) -> None:
    """The config from the metadata is the HF model's (layer types from the sliding-window
    pattern, head sizes and KV heads per layer type, values from the keys where full layers
    have no attn_v, the full layers' rotated share from rope_freqs, both rope thetas, the soft
    cap); every non-expert tensor reads back bit for bit under its HF name (the router's scales
    and the layer scalar renamed, F32 kept as is); each expert reads back as the stored blocks
    of its fused gate_up rows (gate first) and its down rows; a file without the optional
    scales reads them as the ones llama.cpp computes with."""
    path, _, original = gemma4_files["gemma4-q4_k_m"]
    config, ckpt, layout = open_gguf(path)
    _check_config(config, original.config)
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    # what the converter changed, so that the inverses below did something
    assert "blk.1.attn_v.weight" not in stored and "blk.0.attn_v.weight" in stored
    assert "blk.0.ffn_gate_up_exps.weight" in stored and "blk.0.ffn_gate_exps.weight" not in stored
    for leaf in ("ffn_gate_inp.scale", "ffn_down_exps.scale", "layer_output_scale.weight"):
        assert f"blk.0.{leaf}" in stored, leaf
    state = original.state_dict()
    for name, want in state.items():
        if ".experts." in name or name == "lm_head.weight":  # tied: no output.weight
            continue
        got = ckpt.read(name)
        assert got.shape == want.shape and torch.equal(got, want), name
    assert "lm_head.weight" not in ckpt
    # experts: expert e's row is gate_up[e]'s stored blocks (gate rows, then up) and down[e]'s
    (gate_up_type, down_type), _, _ = CASES["gemma4-q4_k_m"]
    fmt = layout.packing(torch.float32)
    for layer in layout.layers:
        raw_gu = stored[f"blk.{layer}.ffn_gate_up_exps.weight"].data
        raw_down = stored[f"blk.{layer}.ffn_down_exps.weight"].data
        for e in (0, 5):
            row = torch.zeros(fmt.numel, dtype=torch.uint8)
            layout.read_into(layer, e, row)
            gate_up, down = fmt.formats[layer].split(row)
            want_gu = gguf.quants.dequantize(raw_gu[e], gate_up_type)
            want_down = gguf.quants.dequantize(raw_down[e], down_type)
            assert torch.equal(gate_up, torch.from_numpy(want_gu)), (layer, e)
            assert torch.equal(down, torch.from_numpy(want_down)), (layer, e)

    # another geometry of the same model: half the full layers' channels rotate, other thetas,
    # no soft cap, window 3, the optional scales left out of layer 0
    variant = tiny_gemma4_model(
        sliding_window=3,
        final_logit_softcapping=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 20000.0,
            },
        },
    )
    other = tmp_path / "variant.gguf"
    drop = ("blk.0.layer_output_scale.weight", "blk.0.ffn_down_exps.scale")
    write_gemma4_gguf(variant, other, drop=drop)
    config, ckpt, _ = open_gguf(other)
    _check_config(config, variant.config)
    assert config.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.5
    assert torch.equal(ckpt.read("model.layers.0.layer_scalar"), torch.ones(1))
    assert torch.equal(ckpt.read("model.layers.0.router.per_expert_scale"), torch.ones(8))
    want = variant.state_dict()["model.layers.1.router.per_expert_scale"]
    assert torch.equal(ckpt.read("model.layers.1.router.per_expert_scale"), want)


@pytest.mark.parametrize(
    "key",
    [
        "attention.sliding_window",
        "attention.key_length_swa",
        "attention.sliding_window_pattern",
        "expert_feed_forward_length",
        "embedding_length_per_layer_input",
    ],
)
def test_gemma4_gguf_missing_metadata_key_named(tmp_path: Path, key: str) -> None:
    path = tmp_path / "gemma4-tiny.gguf"
    write_gemma4_gguf(tiny_gemma4_model(), path, skip=key)
    with pytest.raises(
        CheckpointError,
        match=rf"gemma4-tiny\.gguf: metadata key gemma4\.{re.escape(key)} is missing",
    ):
        open_gguf(path)


def test_gemma4_gguf_without_rope_freqs_named(tmp_path: Path) -> None:
    path = tmp_path / "gemma4-tiny.gguf"
    write_gemma4_gguf(tiny_gemma4_model(), path, drop=("rope_freqs.weight",))
    with pytest.raises(CheckpointError, match=r"no rope_freqs\.weight"):
        open_gguf(path)


def test_gemma4_gguf_tokenizer_from_the_file(tmp_path: Path) -> None:
    """The file's "gemma4" tokenizer is built by transformers' tokenizers backend from the file
    alone (its GGUF config step cannot read gemma4), merges and special tokens included; the
    token ids and the config's special ids are the file's."""
    from moetier.llm import load_tokenizer
    from tests.models.gguf_gemma4_files import TOKENS

    path = tmp_path / "gemma4-tok.gguf"
    write_gemma4_gguf(tiny_gemma4_model(), path, tokenizer=True)
    tok = load_tokenizer(path)
    assert tok is not None
    hi = TOKENS.index("\u2581hi")
    assert tok.encode(" hi hi", add_special_tokens=False) == [hi, hi]
    assert tok.convert_tokens_to_ids("<|channel>") == TOKENS.index("<|channel>")
    config, _, _ = open_gguf(path)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, 1, 0)
