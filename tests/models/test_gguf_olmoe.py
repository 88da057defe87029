"""OLMoE (`olmoe`) GGUF files run directly: greedy tokens and logits equal transformers at 100%
and the minimum expert budget, the config and every tensor read back as the HF model holds
them, missing metadata keys are named.

Transformers' GGUF load reads no olmoe file, so the reference is the HF OLMoE holding gguf's
dequantization of the bytes written (tests/models/gguf_olmoe_files.py), as for gpt-oss."""

from __future__ import annotations

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
from moetier.weights.gguf import open_gguf
from tests.models.gguf_files import (
    Q4_K_M,
    Types,
    check_file_parity,
    reference_model,
    slot_bytes,
)
from tests.models.gguf_olmoe_files import (
    OLMOE_RMS_EPS,
    OLMOE_TINY,
    tiny_olmoe_model,
    write_olmoe_gguf,
)
from tests.models.parity import hf_greedy

# name -> (expert types, non-expert matrices' type): Q8_0 throughout; Q4_K_M's experts
# (down in Q6_K) with F32 non-experts, which the read-back test compares bit for bit
CASES: dict[str, tuple[Types, T]] = {
    "olmoe-q8_0": ((T.Q8_0,) * 3, T.Q8_0),
    "olmoe-q4_k_m": (Q4_K_M, T.F32),
}
OLMOE_D, OLMOE_I, TOP_K = OLMOE_TINY["hidden_size"], OLMOE_TINY["intermediate_size"], 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    """name -> (file, reference model, the HF model it was written from), written on first
    use."""
    root = tmp_path_factory.mktemp("gguf_olmoe")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> tuple[Path, Any, Any]:
            experts, dense = CASES[name]
            path = root / f"{name}.gguf"
            model = tiny_olmoe_model()
            state = write_olmoe_gguf(model, path, experts, dense)
            self[name] = (path, reference_model(model, state), tiny_olmoe_model())
            return self[name]

    return Lazy()


@pytest.mark.parametrize(
    "name,budget",
    [
        pytest.param(name, budget, id=f"{name}-{budget}")
        for name in CASES
        for budget in ("100%", "min")
    ],
)
def test_olmoe_gguf_parity(files: Any, name: str, budget: str) -> None:
    path, ref, _ = files[name]
    experts, _ = CASES[name]
    if budget == "min":
        budget = f"{TOP_K * slot_bytes(experts, OLMOE_D, OLMOE_I)}B"
    check_file_parity(path, ref, budget, TOP_K, name)


def test_olmoe_gguf_config_and_tensors(files: Any) -> None:
    """The config from the metadata is the HF model's (llama.cpp's fixed router: no top-k
    renormalization; no qkv clamp); every non-expert tensor reads back as the HF model holds
    it (F32 file: bit for bit, q/k rows in HF's order, the full-width q/k norms as is) and
    every expert's stored blocks decode to the reference's, in HF's layout."""
    path, ref, original = files["olmoe-q4_k_m"]
    config, ckpt, layout = open_gguf(path)
    want = original.config
    assert config.model_type == "olmoe" and config.architectures == ["OlmoeForCausalLM"]
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob",
        "clip_qkv", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
        "rope_parameters", "attention_bias", "hidden_act",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(want, key), key
    assert config.rms_norm_eps == float(np.float32(OLMOE_RMS_EPS))  # stored as float32
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    # what the converter wrote: llama.cpp's names, k_norm over the kv heads' width
    kv = want.num_key_value_heads * want.hidden_size // want.num_attention_heads
    assert tuple(tensors["blk.1.attn_k_norm.weight"].shape) == (kv,)
    assert tuple(tensors["blk.1.ffn_gate_inp.weight"].shape) == (OLMOE_D, want.num_experts)
    state = original.state_dict()
    for name, value in state.items():
        if ".experts." in name:
            continue
        assert name in ckpt, name
        got = ckpt.read(name)
        assert got.shape == value.shape and torch.equal(got, value), name
    assert layout.layers == [0, 1]
    packing = layout.packing(torch.float32)
    assert packing.name == "gguf-q4_k/gguf-q4_k/gguf-q6_k"
    ref_state = ref.state_dict()
    for layer in layout.layers:
        for expert in (0, 5):
            row = torch.zeros(packing.numel, dtype=torch.uint8)
            layout.read_into(layer, expert, row)
            gate_up, down = packing.formats[layer].split(row)
            prefix = f"model.layers.{layer}.mlp.experts."
            assert torch.equal(gate_up, ref_state[prefix + "gate_up_proj"][expert]), layer
            assert torch.equal(down, ref_state[prefix + "down_proj"][expert]), layer


@pytest.mark.parametrize(
    "key",
    [
        "attention.layer_norm_rms_epsilon",
        "expert_used_count",
        "feed_forward_length",
        "context_length",
    ],
)
def test_olmoe_gguf_missing_metadata_key_named(tmp_path: Path, key: str) -> None:
    path = tmp_path / "olmoe-tiny.gguf"
    write_olmoe_gguf(tiny_olmoe_model(num_hidden_layers=1), path, skip=key)
    with pytest.raises(
        CheckpointError, match=rf"olmoe-tiny\.gguf: metadata key olmoe\.{re.escape(key)} is missing"
    ):
        open_gguf(path)


def test_olmoe_gguf_tokenizer(tmp_path: Path) -> None:
    """The tokenizer comes from the file (llama.cpp's pre-tokenizer "olmo", GPT-2's split,
    which transformers' fallback is), though transformers' GGUF config mapping knows no olmoe:
    text encodes as the model's tokenizer encodes it and generates transformers' tokens."""
    from transformers import AutoTokenizer

    from moetier.llm import load_tokenizer
    from tests.models.gguf_files import greedy_params
    from tests.server.tiny import VOCAB, save_byte_tokenizer

    save_byte_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    model = tiny_olmoe_model(num_hidden_layers=1, vocab_size=VOCAB)
    path = tmp_path / "olmoe-tok.gguf"
    ref = reference_model(model, write_olmoe_gguf(model, path, tokenizer=tok))
    built = load_tokenizer(path)
    text = "Hi there 123, <|im_end|> ok"
    assert built is not None and built.encode(text) == tok.encode(text)
    llm = LLM(str(path), expert_budget="100%", device="cpu", dtype="float32", progress=False)
    out = llm.generate("Hi there 123", greedy_params(4))[0]
    assert out.prompt_token_ids == tok.encode("Hi there 123")
    assert list(out.outputs[0].token_ids) == hf_greedy(ref, tok.encode("Hi there 123"), 4)
