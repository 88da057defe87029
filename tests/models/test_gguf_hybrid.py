"""Qwen3.5-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) GGUF files run directly: greedy tokens and
logits equal transformers, every tensor llama.cpp's converter changed reads back as the HF
model holds it, missing metadata keys are named."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moetier.errors import CheckpointError
from moetier.weights.gguf import open_gguf
from tests.models.gguf_files import (
    check_file_parity,
    reference_model,
    slot_bytes,
    transformers_gguf,
)
from tests.models.gguf_hybrid_files import tiny_hybrid_model, write_hybrid_gguf

# Qwen3.5-MoE (qwen35moe) and Qwen3-Next (qwen3next): written as llama.cpp's converter writes
# them (tests/models/gguf_hybrid_files.py), Q8_0 experts, F32 non-experts, the byte
# tokenizer. Qwen3.5-MoE's reference is transformers' own GGUF load of the file; Qwen3-Next's
# (transformers reads no qwen3next GGUF) the HF model holding gguf's dequantized experts.
HYBRID_D, HYBRID_I, HYBRID_TOP_K = 64, 32, 2


@pytest.fixture(scope="module")
def hybrid_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """family -> (file, reference model, the HF model it was written from)."""
    from transformers import AutoTokenizer

    from tests.server.tiny import CHATML, VOCAB, save_byte_tokenizer

    root = tmp_path_factory.mktemp("hybrid")
    save_byte_tokenizer(root / "tok")
    tok = AutoTokenizer.from_pretrained(root / "tok")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, family: str) -> tuple[Path, Any, Any]:
            path = root / family / "model.gguf"
            path.parent.mkdir()
            model = tiny_hybrid_model(family, vocab_size=VOCAB)
            state = write_hybrid_gguf(model, path, tokenizer=tok, chat_template=CHATML)
            original = tiny_hybrid_model(family, vocab_size=VOCAB)
            if family == "qwen3_5_moe":
                ref = transformers_gguf(path)
            else:
                ref = reference_model(model, state)
            self[family] = (path, ref, original)
            return self[family]

    return Lazy()


@pytest.mark.parametrize(
    "family,budget", [("qwen3_5_moe", "100%"), ("qwen3_5_moe", "min"), ("qwen3_next", "100%")]
)
def test_hybrid_parity(hybrid_files: Any, family: str, budget: str) -> None:
    path, ref, _ = hybrid_files[family]
    if budget == "min":
        budget = f"{HYBRID_TOP_K * slot_bytes((T.Q8_0,) * 3, HYBRID_D, HYBRID_I)}B"
    check_file_parity(path, ref, budget, HYBRID_TOP_K, family, packing="gguf-q8_0")


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_converter_inverses_exact(hybrid_files: Any, family: str) -> None:
    """Every non-expert tensor read back is the HF model's the file was converted from: bit for
    bit where the converter only renamed, reordered or reshaped (value heads tiled, qkvz split,
    conv squeezed), and, where it stored `w + 1` (norms) or `-exp(A_log)`, to the value the model
    computes with (`1 + w`, `exp(A_log)`: float32 keeps no more of w than the file). Qwen3.5's
    also equal transformers' GGUF load of the file, experts included."""
    path, ref, original = hybrid_files[family]
    config, ckpt, layout = open_gguf(path)
    hf = ref.state_dict() if family == "qwen3_5_moe" else {}
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, want in original.state_dict().items():
        if ".experts." in name:
            continue
        got = ckpt.read(name)
        assert got.shape == want.shape, name
        if name.endswith("A_log"):
            assert torch.equal(got.exp(), want.exp()), name
        elif name.endswith("norm.weight") and ".linear_attn." not in name:
            assert torch.equal(1 + got, 1 + want), name
        else:
            assert torch.equal(got, want), name
        if hf:
            assert torch.equal(got, hf[name]), name
    for layer in layout.layers:  # experts: transformers' dequantization of the stored blocks
        row = torch.zeros(layout.packing(torch.float32).numel, dtype=torch.uint8)
        layout.read_into(layer, 1, row)
        gate_up, down = layout.packing(torch.float32).formats[layer].split(row)
        if hf:
            prefix = f"model.layers.{layer}.mlp.experts."
            assert torch.equal(gate_up, hf[prefix + "gate_up_proj"][1]), layer
            assert torch.equal(down, hf[prefix + "down_proj"][1]), layer
    # the file's layout is not HF's: the inverses above did something
    qkv = torch.from_numpy(tensors["blk.0.attn_qkv.weight"].data.copy())
    assert tensors["blk.0.ssm_conv1d.weight"].data.ndim == 2
    hf_qkv = "in_proj_qkv" if family == "qwen3_5_moe" else "in_proj_qkvz"
    assert not torch.equal(
        qkv, original.state_dict()[f"model.layers.0.linear_attn.{hf_qkv}.weight"][: qkv.shape[0]]
    )


def test_hybrid_config_tokenizer_and_mtp(hybrid_files: Any, tmp_path: Path) -> None:
    """The config from the metadata is the HF model's (layer types from full_attention_interval,
    value head width from ssm.inner_size, partial rotary from rope.dimension_count); the
    tokenizer (pre-tokenizer "qwen35") and chat template come from the file; an MTP block
    appended as `blk.{layers}` is not read; a projector (mmproj) file is an error saying what
    to pass."""
    from moetier.llm import load_tokenizer
    from tests.server.tiny import CHATML

    for family, extra in (
        ("qwen3_5_moe", ()),
        ("qwen3_next", ("norm_topk_prob", "mlp_only_layers")),
    ):
        path, _, original = hybrid_files[family]
        want = original.config
        config, _, _ = open_gguf(path)
        for key in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim",
            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "layer_types", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
            "rope_parameters", "model_type", *extra,
        ):  # fmt: skip
            assert getattr(config, key) == getattr(want, key), (family, key)
        assert config.rms_norm_eps == float(np.float32(want.rms_norm_eps))  # stored as float32
        assert config.architectures == [type(original).__name__], family
        tok = load_tokenizer(path)  # qwen3next: transformers' GGUF config step reads none
        assert tok is not None and tok.chat_template == CHATML, family
        text = "Hi <|im_end|> there"
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert tok.encode(text) == [*b"Hi ", im_end, *b" there"], family
    path, _, original = hybrid_files["qwen3_5_moe"]
    want = original.config

    mtp = tmp_path / "mtp.gguf"
    write_hybrid_gguf(original, mtp, mtp=True)
    config, ckpt, layout = open_gguf(mtp)
    assert config.num_hidden_layers == want.num_hidden_layers
    assert layout.layers == list(range(want.num_hidden_layers))
    assert f"blk.{want.num_hidden_layers}.ffn_gate_exps.weight" in ckpt.file.tensors  # unread

    mmproj = tmp_path / "mmproj-Qwen3.6-35B-A3B-F16.gguf"
    w = gguf.GGUFWriter(str(mmproj), "clip")
    w.add_tensor("v.patch_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"mmproj-.*\.gguf: a vision projector \(mmproj\)"):
        open_gguf(mmproj)


@pytest.mark.parametrize(
    "family,key",
    [
        ("qwen3_5_moe", "ssm.conv_kernel"),
        ("qwen3_5_moe", "ssm.inner_size"),
        ("qwen3_5_moe", "rope.dimension_sections"),
        ("qwen3_next", "ssm.state_size"),
        ("qwen3_next", "attention.layer_norm_rms_epsilon"),
    ],
)
def test_hybrid_missing_metadata_key_named(tmp_path: Path, family: str, key: str) -> None:
    path = tmp_path / f"{family}-tiny.gguf"
    write_hybrid_gguf(tiny_hybrid_model(family), path, skip=key)
    arch = "qwen35moe" if family == "qwen3_5_moe" else "qwen3next"
    with pytest.raises(
        CheckpointError,
        match=rf"{family}-tiny\.gguf: metadata key {arch}\.{re.escape(key)} is missing",
    ):
        open_gguf(path)
