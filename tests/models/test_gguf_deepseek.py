"""GLM-4.5 (`glm4moe`) and DeepSeek-V2/V3 (`deepseek2`) GGUF files run directly: greedy tokens and
logits equal transformers, the config and every tensor read back, missing metadata keys named,
and no tokenizer built where transformers lacks the file's pre-tokenizer (`tokenizer=` instead)."""

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
from moetier.errors import CheckpointError, ConfigError
from moetier.weights.gguf import open_gguf
from tests.models.gguf_deepseek_files import write_deepseek2_gguf, write_glm4moe_gguf
from tests.models.gguf_files import (
    check_file_parity,
    greedy_params,
    reference_model,
    slot_bytes,
    tiny_hf_model,
)
from tests.models.parity import PROMPTS, hf_greedy, moetier_greedy

# GLM-4.5 (glm4moe) and DeepSeek-V2/V3 (deepseek2), which transformers' GGUF load cannot read:
# the HF model holding gguf's dequantization of the bytes written, as for gpt-oss. name ->
# (family, writer options): GLM with its NextN block appended; DeepSeek-V3 as the converter
# writes it now (kv_b_proj split into attn_k_b / attn_v_b, sigmoid router, yarn); DeepSeek-V2
# (V2-Lite's shape) as older converters wrote it (attn_kv_b whole, no gating or group keys).
DS_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "glm4_moe": ("glm4_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v2-kv_b": ("deepseek_v2", {"legacy": True}),
}
DS_D, DS_I = 64, 32
DS_TOP_K = {"glm4_moe": 3, "deepseek_v3": 4, "deepseek_v2": 3}


@pytest.fixture(scope="module")
def ds_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each case's GGUF file (Q8_0 experts, F32 rest) and its reference, written on first use."""
    root = tmp_path_factory.mktemp("gguf_ds")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> tuple[Path, Any]:
            family, options = DS_CASES[name]
            path = root / f"{name}.gguf"
            model = tiny_hf_model(family)
            write = write_glm4moe_gguf if family == "glm4_moe" else write_deepseek2_gguf
            self[name] = (path, reference_model(model, write(model, path, **options)))
            return self[name]

    return Lazy()


@pytest.mark.parametrize(
    "name,budget",
    [
        ("glm4_moe", "100%"),
        ("glm4_moe", "min"),
        ("deepseek_v3", "100%"),
        ("deepseek_v3", "min"),
        ("deepseek_v2-kv_b", "100%"),
    ],
)
def test_glm_deepseek_parity(ds_files: Any, name: str, budget: str) -> None:
    path, ref = ds_files[name]
    top_k = DS_TOP_K[DS_CASES[name][0]]
    if budget == "min":
        budget = f"{top_k * slot_bytes((T.Q8_0,) * 3, DS_D, DS_I)}B"
    check_file_parity(path, ref, budget, top_k, name, packing="gguf-q8_0")


@pytest.mark.parametrize("name", list(DS_CASES))
def test_glm_deepseek_config_and_tensors(ds_files: Any, name: str) -> None:
    """The config comes from the metadata (the NextN block and MLA's MQA form undone) and
    every tensor the HF model holds reads back exactly (kv_b_proj reassembled per head from
    attn_k_b / attn_v_b, or read whole)."""
    path, ref = ds_files[name]
    config, ckpt, layout = open_gguf(path)
    want = ref.config
    assert config.architectures == [type(ref).__name__]
    keys = [
        "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "n_group", "topk_group", "routed_scaling_factor", "vocab_size", "tie_word_embeddings",
        "max_position_embeddings",
    ]  # fmt: skip
    if want.model_type == "glm4_moe":
        keys += ["attention_bias", "use_qk_norm", "norm_topk_prob", "rope_parameters"]
    else:
        keys += ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"]
        v3 = want.model_type == "deepseek_v3"
        keys += ["v_head_dim", "norm_topk_prob" if v3 else "topk_method"]
    for key in keys:
        assert getattr(config, key) == getattr(want, key), key
    assert config.rms_norm_eps == float(np.float32(want.rms_norm_eps))  # stored as float32
    if want.model_type == "deepseek_v3":  # yarn's mscale from 0.1 x mscale_all_dim (float32)
        rope = dict(config.rope_parameters)
        assert rope.pop("mscale") == rope.pop("mscale_all_dim") == pytest.approx(0.707)
        assert rope == {
            k: v for k, v in want.rope_parameters.items() if k not in ("mscale", "mscale_all_dim")
        }
    assert layout.layers == list(range(1, want.num_hidden_layers))
    tensors = {t.name for t in gguf.GGUFReader(path).tensors}
    split = {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"}
    if name == "deepseek_v3":
        assert split <= tensors and "blk.1.attn_kv_b.weight" not in tensors
    elif name == "deepseek_v2-kv_b":
        assert "blk.1.attn_kv_b.weight" in tensors and not split & tensors
    else:  # the NextN block is in the file, not in the model
        n = want.num_hidden_layers
        assert f"blk.{n}.nextn.eh_proj.weight" in tensors and f"blk.{n}.attn_q.weight" in tensors
        assert not any(f"layers.{n}." in hf for hf in ckpt.names)
    state = ref.state_dict()
    for hf_name, value in state.items():
        if ".experts." not in hf_name:
            assert hf_name in ckpt, hf_name
            assert torch.equal(ckpt.read(hf_name), value), hf_name


@pytest.mark.parametrize(
    "family,key",
    [
        ("glm4_moe", "expert_shared_count"),
        ("glm4_moe", "attention.layer_norm_rms_epsilon"),
        ("deepseek_v3", "attention.kv_lora_rank"),
        ("deepseek_v3", "rope.scaling.yarn_log_multiplier"),
    ],
)
def test_glm_deepseek_missing_metadata_key_named(tmp_path: Path, family: str, key: str) -> None:
    path = tmp_path / "tiny.gguf"
    model = tiny_hf_model(family)
    if family == "glm4_moe":
        write_glm4moe_gguf(model, path, skip=key)
    else:
        write_deepseek2_gguf(model, path, skip=key)
    arch = "glm4moe" if family == "glm4_moe" else "deepseek2"
    with pytest.raises(
        CheckpointError, match=rf"tiny\.gguf: metadata key {arch}\.{re.escape(key)} is missing"
    ):
        open_gguf(path)


def test_glm_deepseek_tokenizer(tmp_path: Path) -> None:
    """GLM-4.5's pre-tokenizer ("glm4") has no split in transformers' GGUF tokenizer, which
    would fall back to GPT-2's: no tokenizer is built (a CheckpointError says to pass the
    model's tokenizer as --tokenizer, or token ids); the model still runs on token ids, and
    with `tokenizer=` on text. A pre-tokenizer transformers knows builds."""
    from transformers import AutoTokenizer

    from moetier.llm import load_tokenizer
    from tests.server.tiny import VOCAB, save_byte_tokenizer

    save_byte_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    model = tiny_hf_model("glm4_moe", vocab_size=VOCAB)
    path = tmp_path / "GLM-tiny.gguf"
    ref = reference_model(model, write_glm4moe_gguf(model, path, tokenizer=tok))
    message = r"GLM-tiny\.gguf: transformers cannot build .* 'glm4'.*as --tokenizer"
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(path)
    llm = LLM(str(path), expert_budget="100%", device="cpu", dtype="float32", progress=False)
    assert llm.tokenizer is None
    assert moetier_greedy(llm, PROMPTS[:1], 4)[0] == hf_greedy(ref, PROMPTS[0], 4)
    with pytest.raises(CheckpointError, match=message):
        llm.generate("hello", greedy_params(4))
    # the model's Hugging Face tokenizer passed instead: text prompts encode through it
    given = LLM(
        str(path),
        tokenizer=tmp_path / "tok",
        expert_budget="100%",
        device="cpu",
        dtype="float32",
        progress=False,
    )
    text = "Hi there 123"
    out = given.generate(text, greedy_params(4))[0]
    assert out.prompt_token_ids == tok.encode(text)
    assert list(out.outputs[0].token_ids) == hf_greedy(ref, tok.encode(text), 4)
    with pytest.raises(ConfigError, match=r"tokenizer .*missing-tok: transformers cannot load"):
        load_tokenizer(path, tmp_path / "missing-tok")
    known = tmp_path / "gpt2-pre.gguf"
    write_glm4moe_gguf(model, known, tokenizer=tok, pre="qwen2")
    built = load_tokenizer(known)
    assert built is not None and built.encode("Hi there 123") == tok.encode("Hi there 123")
