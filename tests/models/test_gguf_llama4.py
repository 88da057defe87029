"""Llama 4 text (`llama4`) GGUF files run directly: greedy tokens and logits equal transformers
at 100% and the minimum expert budget, the config (with what llama.cpp fixes for llama4) and
every tensor the converter renamed, split or transposed read back as the HF model holds them,
llama3 rope read back from `rope_freqs`, missing metadata keys are named, the tokenizer is the
file's.

transformers' GGUF load reads no llama4 file, so the reference is the HF model holding gguf's
dequantization of the bytes written (tests/models/gguf_llama4_files.py), as for gpt-oss.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moetier import LLM
from moetier.errors import CheckpointError
from moetier.layers.rotary import RotaryEmbedding
from moetier.weights.gguf import open_gguf
from tests.models.gguf_files import Q4_K_M, check_file_parity, reference_model, slot_bytes
from tests.models.gguf_llama4_files import (
    LLAMA4_K,
    tiny_llama4_model,
    write_llama4_gguf,
)
from tests.models.parity import hf_greedy

# name -> (expert types gate, up, down; non-expert matrices' type; model overrides)
# Q8_0 everywhere at D 64 / I 32; Q4_K_M's experts at D = I = 256 with F32 non-experts
CASES: dict[str, tuple[tuple[T, T, T], T, dict[str, Any]]] = {
    "llama4-q8_0": ((T.Q8_0,) * 3, T.Q8_0, {}),
    "llama4-q4_k_m": (Q4_K_M, T.F32, LLAMA4_K),  # type: ignore[dict-item]
}
TOP_K = 1


@pytest.fixture(scope="module")
def llama4_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """name -> (file, reference model, the HF model it was written from), written on first use."""
    root = tmp_path_factory.mktemp("gguf_llama4")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> tuple[Path, Any, Any]:
            experts, dense, overrides = CASES[name]
            path = root / f"{name}.gguf"
            model = tiny_llama4_model(**overrides)
            state = write_llama4_gguf(model, path, experts, dense)
            self[name] = (path, reference_model(model, state), tiny_llama4_model(**overrides))
            return self[name]

    return Lazy()


@pytest.mark.parametrize(
    "name,budget",
    [pytest.param(n, b, id=f"{n}-{b}") for n in CASES for b in ("100%", "min")],
)
def test_llama4_gguf_parity(llama4_files: Any, name: str, budget: str) -> None:
    path, ref, original = llama4_files[name]
    experts, _, _ = CASES[name]
    if budget == "min":
        d, i = original.config.hidden_size, original.config.intermediate_size
        budget = f"{TOP_K * slot_bytes(experts, d, i)}B"
    check_file_parity(path, ref, budget, TOP_K, name)


def _inv_freq(config: Any) -> torch.Tensor:
    return RotaryEmbedding(config, int(config.head_dim)).inv_freq


def _check_config(config: Any, want: Any) -> None:
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "max_position_embeddings", "num_local_experts", "num_experts_per_tok",
        "interleave_moe_layer_step", "moe_layers", "no_rope_layers", "attention_chunk_size",
        "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm",
        "attention_bias", "hidden_act", "tie_word_embeddings", "model_type",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(want, key), key
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # stored as float32
    assert config.architectures == ["Llama4ForCausalLM"]
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert config.rope_parameters["rope_type"] == want.rope_parameters["rope_type"]
    # the rotary frequencies moetier computes from the config read back are HF's
    torch.testing.assert_close(_inv_freq(config), _inv_freq(want), rtol=1e-6, atol=0)


def test_llama4_gguf_config_and_converter_inverses(llama4_files: Any, tmp_path: Path) -> None:
    """The config from the metadata is the HF model's (widths swapped back: feed_forward_length
    is the dense MLP's, expert_feed_forward_length the experts'; MoE layers from the interleave
    step; NoPE / chunked layers, chunk, temperature and q/k norm as llama.cpp fixes them; llama3
    rope from rope_freqs); every non-expert tensor reads back bit for bit under its HF name (q/k
    rows as stored: not permuted for llama4); each expert's stored blocks are the split and
    transposed halves of HF's fused gate_up_proj and its transposed down_proj."""
    path, ref, original = llama4_files["llama4-q4_k_m"]
    config, ckpt, layout = open_gguf(path)
    _check_config(config, original.config)
    want_rope = original.config.rope_parameters
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert config.rope_parameters[key] == pytest.approx(want_rope[key]), key
    assert config.rope_parameters["original_max_position_embeddings"] == 32
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    # what the converter wrote: split experts [E, I, D] / [E, D, I] (gguf lists dims reversed)
    d, i, e = 256, 256, original.config.num_local_experts
    assert "blk.1.ffn_gate_up_exps.weight" not in stored
    assert "blk.0.ffn_gate_exps.weight" not in stored and "blk.0.ffn_gate.weight" in stored
    assert list(stored["blk.1.ffn_gate_exps.weight"].shape) == [d, i, e]
    assert list(stored["blk.1.ffn_down_exps.weight"].shape) == [i, d, e]
    assert "rope_freqs.weight" in stored
    state = original.state_dict()
    for name, want in state.items():
        if ".experts." in name:
            continue
        assert name in ckpt, name
        got = ckpt.read(name)
        assert got.shape == want.shape and torch.equal(got, want), name
    assert layout.layers == [1, 3]
    packing = layout.packing(torch.float32)
    assert packing.name == "gguf-q4_k/gguf-q4_k/gguf-q6_k"
    ref_state = ref.state_dict()
    for layer in layout.layers:
        prefix = f"model.layers.{layer}.feed_forward.experts."
        for expert in (0, 5):
            row = torch.zeros(packing.numel, dtype=torch.uint8)
            layout.read_into(layer, expert, row)
            gate_up, down = packing.formats[layer].split(row)  # [2I, D], [D, I]
            hf_gate_up = ref_state[prefix + "gate_up_proj"][expert]  # [D, 2I]
            hf_down = ref_state[prefix + "down_proj"][expert]  # [I, D]
            assert torch.equal(gate_up, hf_gate_up.t()), (layer, expert)
            assert torch.equal(down, hf_down.t()), (layer, expert)


@pytest.mark.parametrize(
    "variant",
    [
        # Llama-4-Scout's rope (low = high freq factor: no interpolated pair) and 128 experts'
        # fixed q/k norm off (Maverick's), unscaled rope, all layers full attention (the
        # converter's sliding_window 0: no NoPE, no chunks), another llama3 geometry
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=10**6,
        ),
        dict(num_local_experts=128, use_qk_norm=False, rope_parameters=None),
        dict(
            attention_chunk_size=None,
            no_rope_layers=[1, 1, 1, 1],
            interleave_moe_layer_step=1,
            attention_bias=False,
        ),
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 20000.0,
                "factor": 4.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 3.0,
                "original_max_position_embeddings": 100,
            }
        ),
    ],
    ids=["scout-rope", "maverick-128e", "all-full", "llama3-other"],
)
def test_llama4_gguf_config_variants(tmp_path: Path, variant: dict[str, Any]) -> None:
    """Other geometries read back as the HF model's config (rope as its inverse frequencies)."""
    if variant.get("rope_parameters", 0) is None:
        variant = {**variant, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    model = tiny_llama4_model(num_hidden_layers=4, **variant)
    path = tmp_path / "variant.gguf"
    write_llama4_gguf(model, path)
    config, ckpt, _ = open_gguf(path)
    _check_config(config, model.config)
    if "rope_freqs.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}:
        assert config.rope_parameters["rope_type"] == "default"
    if variant.get("rope_parameters", {}).get("high_freq_factor") == 1.0:  # Scout's own values
        assert config.rope_parameters["original_max_position_embeddings"] == 8192
        assert config.rope_parameters["low_freq_factor"] == 1.0


def test_llama4_gguf_rope_freqs_not_llama3_named(tmp_path: Path) -> None:
    """rope_freqs that no llama3 scaling gives are refused, not approximated."""
    from tests.models import gguf_llama4_files

    path = tmp_path / "llama4-tiny.gguf"
    original = gguf_llama4_files.rope_freqs

    def scrambled(cfg: Any) -> np.ndarray:
        freqs = original(cfg)
        assert freqs is not None
        return freqs[::-1].copy()

    gguf_llama4_files.rope_freqs = scrambled  # type: ignore[assignment]
    try:
        write_llama4_gguf(tiny_llama4_model(num_hidden_layers=4), path)
    finally:
        gguf_llama4_files.rope_freqs = original
    with pytest.raises(CheckpointError, match=r"is not llama3 rope scaling's factors"):
        open_gguf(path)


@pytest.mark.parametrize(
    "key",
    [
        "interleave_moe_layer_step",
        "expert_feed_forward_length",
        "feed_forward_length",
        "attention.layer_norm_rms_epsilon",
        "expert_used_count",
    ],
)
def test_llama4_gguf_missing_metadata_key_named(tmp_path: Path, key: str) -> None:
    path = tmp_path / "llama4-tiny.gguf"
    write_llama4_gguf(tiny_llama4_model(), path, skip=key)
    with pytest.raises(
        CheckpointError,
        match=rf"llama4-tiny\.gguf: metadata key llama4\.{re.escape(key)} is missing",
    ):
        open_gguf(path)


def test_llama4_gguf_tokenizer(tmp_path: Path) -> None:
    """The tokenizer comes from the file (llama.cpp's pre-tokenizer "llama4", which
    transformers splits by its own table's pattern for it), though transformers' GGUF config
    mapping knows no llama4: text encodes as the model's tokenizer encodes it and generates
    transformers' tokens."""
    from transformers import AutoTokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from moetier.llm import load_tokenizer
    from tests.models.gguf_files import greedy_params
    from tests.server.tiny import VOCAB, save_byte_tokenizer

    save_byte_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    model = tiny_llama4_model(num_hidden_layers=2, vocab_size=VOCAB)
    path = tmp_path / "llama4-tok.gguf"
    ref = reference_model(model, write_llama4_gguf(model, path, tokenizer=tok))
    built = load_tokenizer(path)
    assert built is not None
    state = json.loads(built.backend_tokenizer.pre_tokenizer.__getstate__())
    assert state["pretokenizers"][0]["pattern"]["Regex"] == GGUF_PRE_TOKENIZER_SPLITS["llama4"]
    text = "Hi there 123, <|im_end|> ok"
    assert built.encode(text) == tok.encode(text)
    llm = LLM(str(path), expert_budget="100%", device="cpu", dtype="float32", progress=False)
    out = llm.generate("Hi there 123", greedy_params(4))[0]
    assert out.prompt_token_ids == tok.encode("Hi there 123")
    assert list(out.outputs[0].token_ids) == hf_greedy(ref, tok.encode("Hi there 123"), 4)
