"""GGUF files run directly: greedy tokens equal transformers' load of the same file.

Tiny random HF models are written as GGUF (tests/models/gguf_files.py) with experts in Q4_K
(down in Q6_K, as Q4_K_M stores it) or Q8_0 and non-experts in F32 or Q8_0. Qwen3-MoE and
Qwen2-MoE are compared with `from_pretrained(dir, gguf_file=...)` (which dequantizes every
tensor; it reads no expert width from the file, so the test passes it); Mixtral, which llama.cpp
writes as arch llama and transformers loads as a dense Llama, with the HF Mixtral holding gguf's
dequantization of the same bytes. gpt-oss (which transformers' GGUF load cannot read) likewise:
the HF gpt-oss holding gguf's dequantization, itself checked equal to transformers' load of the
HF MXFP4 checkpoint the file was converted from.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moetier import LLM
from moetier.errors import BudgetError, CheckpointError
from moetier.weights.gguf import open_gguf
from moetier.weights.mxfp4 import MXFP4
from tests.models.gguf_files import (
    NEW,
    Q4_K_M,
    Types,
    check_file_parity,
    greedy_params,
    reference_model,
    slot_bytes,
    tiny_hf_model,
    transformers_gguf,
    write_gguf,
    write_gpt_oss_gguf,
)
from tests.models.parity import PROMPTS, hf_greedy, hf_last_logits, moetier_greedy

# name -> (family, expert types, non-expert type)
# Q4_K_M as llama.cpp writes it: down in Q6_K in some layers, Q4_K in others
MIXED = {0: Q4_K_M, 1: (T.Q4_K,) * 3}
CASES: dict[str, tuple[str, Types, T]] = {
    "qwen3_moe-q4_k_m": ("qwen3_moe", Q4_K_M, T.F32),
    "qwen3_moe-q8_0": ("qwen3_moe", (T.Q8_0,) * 3, T.Q8_0),
    "mixtral-q4_k_m": ("mixtral", Q4_K_M, T.F32),
    "mixtral-q8_0": ("mixtral", (T.Q8_0,) * 3, T.Q8_0),
    "qwen2_moe-q4_k_m": ("qwen2_moe", Q4_K_M, T.F32),
    # every matrix block-quantized, non-experts too (real files store them so)
    "qwen3_moe-q5_k-q6_k": ("qwen3_moe", (T.Q5_K,) * 3, T.Q6_K),
    "qwen3_moe-q4_k_m-mixed": ("qwen3_moe", MIXED, T.Q8_0),
    # one tensor per expert (blk.N.ffn_gate.E.weight), as the first Mixtral GGUF files
    "mixtral-per_expert": ("mixtral", MIXED, T.F32),
}
_SIZES = {"qwen3_moe": (256, 256), "qwen2_moe": (256, 256), "mixtral": (256, 256)}  # (D, I)


def _widths(family: str) -> dict[str, Any]:
    """What transformers' GGUF config leaves out and the file states (the expert widths)."""
    if family == "qwen3_moe":
        return {"moe_intermediate_size": 256}
    if family == "qwen2_moe":
        return {"moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}
    return {}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each case's GGUF file and its reference model (written on first use)."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, tuple[Path, Any]] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> tuple[Path, Any]:
            family, experts, dense = CASES[name]
            path = root / name / "model.gguf"
            path.parent.mkdir()
            model = tiny_hf_model(family)
            state = write_gguf(model, path, experts, dense, per_expert="per_expert" in name)
            if family == "mixtral":
                ref = reference_model(model, state)
            else:
                ref = transformers_gguf(path, **_widths(family))
            self[name] = (path, ref)
            return self[name]

    return Lazy(made)


def _budget(name: str, which: str) -> str:
    family, experts, _ = CASES[name]
    top_k = 2 if family == "mixtral" else 4
    if which == "min":
        return f"{top_k * slot_bytes(experts, *_SIZES[family])}B"
    return which


@pytest.mark.parametrize("budget", ["100%", "50%", "min"])
@pytest.mark.parametrize("name", list(CASES))
def test_gguf_parity(files: Any, name: str, budget: str) -> None:
    path, ref = files[name]
    llm = LLM(
        str(path),
        expert_budget=_budget(name, budget),
        device="cpu",
        dtype="float32",
        progress=False,
    )
    assert llm.engine.runner.expert_cache.packing.compressed
    got = moetier_greedy(llm, PROMPTS, NEW)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(ref, prompt, NEW), f"{name} {budget}: prompt {prompt}"
    torch.testing.assert_close(
        llm.prompt_logits(PROMPTS[0]), hf_last_logits(ref, PROMPTS[0]), rtol=1e-4, atol=1e-4
    )
    llm.engine.runner.expert_cache.check_integrity()


def test_reference_writer_agrees_with_transformers(files: Any, tmp_path: Path) -> None:
    """The Mixtral reference's construction (the HF model holding gguf's dequantization of the
    bytes written) gives transformers' own GGUF load where transformers has one (Qwen3-MoE)."""
    model = tiny_hf_model("qwen3_moe", seed=3)
    path = tmp_path / "m.gguf"
    state = write_gguf(model, path, Q4_K_M, T.Q8_0, seed=3)
    hf = transformers_gguf(path, **_widths("qwen3_moe"))
    for name, value in hf.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)


def test_layout_keeps_stored_types(files: Any) -> None:
    path, _ = files["qwen3_moe-q4_k_m"]
    config, ckpt, layout = open_gguf(path)
    assert (config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok) == (
        256,
        8,
        4,
    )
    packing = layout.packing(torch.float32)
    assert packing.name == "gguf-q4_k/gguf-q4_k/gguf-q6_k"
    assert packing.nbytes == slot_bytes(Q4_K_M, 256, 256) == 2 * 256 * 144 + 256 * 210
    assert layout.source_bytes(1, 3) == 2 * 256 * 144 + 256 * 210
    row = torch.zeros(packing.numel, dtype=torch.uint8)
    assert layout.read_into(1, 3, row) == layout.source_bytes(1, 3)
    gate_up, down = packing.formats[1].split(row)
    # the expert's blocks as gguf dequantizes them from the file
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    for part, got in (("gate", gate_up[:256]), ("up", gate_up[256:]), ("down", down)):
        t = tensors[f"blk.1.ffn_{part}_exps.weight"]
        want = gguf.quants.dequantize(t.data[3], t.tensor_type)
        assert torch.equal(got, torch.from_numpy(want.copy())), part


def test_per_layer_types_and_per_expert_tensors(files: Any) -> None:
    """A Q4_K_M file whose down is Q6_K in one layer and Q4_K in the other: each layer decodes
    its own types, a slot holds the larger; per-expert tensors read the same way."""
    for name in ("qwen3_moe-q4_k_m-mixed", "mixtral-per_expert"):
        path, _ = files[name]
        _, _, layout = open_gguf(path)
        packing = layout.packing(torch.float32)
        names = {layer: f.name for layer, f in packing.formats.items()}
        assert names == {0: "gguf-q4_k/gguf-q4_k/gguf-q6_k", 1: "gguf-q4_k"}, name
        assert packing.nbytes == slot_bytes(Q4_K_M, 256, 256) > packing.formats[1].nbytes
        assert layout.source_bytes(1, 5) == 3 * 256 * 144
        row = torch.zeros(packing.numel, dtype=torch.uint8)
        assert layout.read_into(1, 5, row) == 3 * 256 * 144
        gate_up, down = packing.formats[1].split(row)
        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        per = "per_expert" in name
        for part, got in (("gate", gate_up[:256]), ("up", gate_up[256:]), ("down", down)):
            t = tensors[f"blk.1.ffn_{part}.5.weight" if per else f"blk.1.ffn_{part}_exps.weight"]
            want = gguf.quants.dequantize(t.data if per else t.data[5], t.tensor_type)
            assert torch.equal(got, torch.from_numpy(want.copy())), (name, part)


def test_budget_buys_slots_of_stored_bytes(files: Any) -> None:
    """Slots are counted in encoded bytes: a 25% budget of the Q4_K_M file and a byte budget
    buy what those bytes allow, many more than the same bytes of float32 experts would."""
    path, _ = files["qwen3_moe-q4_k_m"]
    slot = slot_bytes(Q4_K_M, 256, 256)
    dense = 3 * 256 * 256 * 4
    total = 2 * 8  # MoE layers x experts
    llm = LLM(str(path), expert_budget="25%", device="cpu", dtype="float32", progress=False)
    plan = llm.engine.runner.tier_plan
    assert (plan.expert_bytes, plan.device_slots) == (slot, total * slot // 4 // slot)
    budget = 7 * slot + slot // 2
    assert budget // dense == 1
    llm = LLM(str(path), expert_budget=f"{budget}B", device="cpu", dtype="float32", progress=False)
    assert llm.engine.runner.tier_plan.device_slots == 7
    with pytest.raises(BudgetError, match="top-k = 4"):
        LLM(str(path), expert_budget=f"{4 * slot - 1}B", device="cpu", progress=False)


def test_gguf_tokenizer_chat_template_and_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    from tests.server.tiny import CHATML, VOCAB, save_byte_tokenizer

    save_byte_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    path = tmp_path / "chat.gguf"
    write_gguf(
        tiny_hf_model("mixtral", vocab_size=VOCAB),
        path,
        (T.Q8_0,) * 3,
        T.F32,
        tokenizer=tok,
        chat_template=CHATML,
    )
    llm = LLM(str(path), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    assert llm.tokenizer is not None and llm.tokenizer.chat_template == CHATML
    text = "Hi <|im_end|> there"
    assert llm.tokenizer.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "hey"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    reply = llm.chat(msgs, greedy_params(6))
    assert reply.prompt_token_ids == tok.encode(want)
    assert len(reply.outputs[0].token_ids) == 6 and reply.outputs[0].text
    # `moetier generate file.gguf` (the model as a positional argument) says the same
    from moetier.cli import main

    args = ["generate", str(path), "--prompt", "hey", "--max-tokens", "6", "--device", "cpu"]
    assert main([*args, "--dtype", "float32", "--expert-budget", "50%"]) == 0
    assert capsys.readouterr().out == reply.outputs[0].text + "\n"
    assert main([*args, "--model", str(path)]) == 2
    assert "give the model once" in capsys.readouterr().err


def test_gguf_server(files: Any, tmp_path: Path) -> None:
    """`moetier serve file.gguf` at half the expert bytes answers transformers' greedy tokens."""
    from tests.server.conftest import start_server, stop_server

    path, ref = files["qwen3_moe-q4_k_m"]
    server = start_server(path, tmp_path / "server.log", "--expert-budget", "50%")
    try:
        for prompt in PROMPTS[:2]:
            body = {
                "model": server.model,
                "prompt": prompt,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(ref, prompt, NEW)
    finally:
        assert stop_server(server) == 0


def test_missing_or_truncated_file(files: Any, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nothere\.gguf: no such file"):
        LLM(str(tmp_path / "nothere.gguf"), device="cpu", progress=False)
    path, _ = files["mixtral-q8_0"]
    with pytest.raises(
        CheckpointError, match=r"no config\.json.*pass its path, e\.g\. .*model\.gguf"
    ):
        LLM(str(path.parent), device="cpu", progress=False)  # the directory holding the file
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated"):
        open_gguf(cut)
    cut.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated"):
        open_gguf(cut)


def test_unsupported_arch_and_dense_file(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"phi\.gguf.*'phi2' is not supported.*qwen3moe"):
        open_gguf(path)
    dense = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(dense), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"llama\.gguf.*without experts"):
        open_gguf(dense)


def test_unsupported_expert_type_names_tensor(tmp_path: Path) -> None:
    path = tmp_path / "q4_0.gguf"
    model = tiny_hf_model("mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=1)
    write_gguf(model, path, (T.Q4_0, T.Q8_0, T.Q8_0), T.F32)
    with pytest.raises(
        CheckpointError,
        match=r"q4_0\.gguf: tensor blk\.0\.ffn_gate_exps\.weight "
        r"is stored as Q4_0.*supported: .*Q4_K",
    ):
        open_gguf(path)


def test_gguf_file_copied_elsewhere_still_loads(files: Any, tmp_path: Path) -> None:
    """The file alone is the model: no config.json or tokenizer files beside it are needed."""
    path, ref = files["mixtral-q8_0"]
    alone = tmp_path / "alone" / "Mixtral-Tiny.Q8_0.gguf"
    alone.parent.mkdir()
    shutil.copy(path, alone)
    llm = LLM(str(alone), expert_budget="100%", device="cpu", dtype="float32", progress=False)
    assert moetier_greedy(llm, PROMPTS[:1], 8)[0] == hf_greedy(ref, PROMPTS[0], 8)


def test_non_expert_types_the_gguf_package_reads(tmp_path: Path) -> None:
    """Non-expert tensors in a type moetier has no codec for (Q4_0: some files' fallback where
    rows are no whole K blocks) are dequantized by the gguf package at load."""
    model = tiny_hf_model("mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=1)
    path = tmp_path / "q4_0.gguf"
    ref = reference_model(model, write_gguf(model, path, (T.Q8_0,) * 3, T.Q4_0))
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors if t.name == "blk.0.attn_q.weight"} == {T.Q4_0}
    llm = LLM(str(path), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    assert moetier_greedy(llm, PROMPTS[:2], 8) == [hf_greedy(ref, p, 8) for p in PROMPTS[:2]]


# gpt-oss: name -> (expert type, non-expert matrices' type). MXFP4 experts as the released
# files keep them (repacked from the HF MXFP4 checkpoint); Q8_0 as converted from float experts.
GPT_OSS_CASES: dict[str, tuple[T, T]] = {
    "gpt_oss-mxfp4": (T.MXFP4, T.F32),
    "gpt_oss-q8_0": (T.Q8_0, T.Q8_0),
}
GPT_OSS_D, GPT_OSS_I, GPT_OSS_TOP_K = 64, 32, 4


@pytest.fixture(scope="module")
def gpt_oss_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each gpt-oss case's GGUF file and its reference (the HF model holding gguf's
    dequantization of the bytes written), written on first use."""
    root = tmp_path_factory.mktemp("gguf_gpt_oss")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> tuple[Path, Any]:
            experts, dense = GPT_OSS_CASES[name]
            path = root / f"{name}.gguf"
            model = tiny_hf_model("gpt_oss")
            self[name] = (
                path,
                reference_model(model, write_gpt_oss_gguf(model, path, experts, dense)),
            )
            return self[name]

    return Lazy()


@pytest.mark.parametrize(
    "name,budget", [("gpt_oss-mxfp4", "100%"), ("gpt_oss-mxfp4", "min"), ("gpt_oss-q8_0", "100%")]
)
def test_gpt_oss_parity(gpt_oss_files: Any, name: str, budget: str) -> None:
    path, ref = gpt_oss_files[name]
    if budget == "min":
        experts = (GPT_OSS_CASES[name][0],) * 3
        budget = f"{GPT_OSS_TOP_K * slot_bytes(experts, GPT_OSS_D, GPT_OSS_I)}B"
    check_file_parity(
        path, ref, budget, GPT_OSS_TOP_K, name, packing="mxfp4" if "mxfp4" in name else "gguf-q8_0"
    )


def test_gpt_oss_reference_agrees_with_transformers(tmp_path: Path) -> None:
    """The gpt-oss reference (gguf's dequantization of the file's MXFP4 blocks, gate and up
    interleaved back) is transformers' own dequantization of the HF MXFP4 checkpoint the file
    was converted from, every tensor (biases, sinks, router) equal."""
    from tests.models.test_gpt_oss import reference, to_mxfp4

    model = tiny_hf_model("gpt_oss", seed=3)
    state = write_gpt_oss_gguf(model, tmp_path / "m.gguf", T.MXFP4, T.F32)
    model.save_pretrained(tmp_path / "dense")
    hf = reference(to_mxfp4(tmp_path / "dense", tmp_path / "mxfp4"))
    got = hf.state_dict()
    assert got.keys() == state.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(
        state["model.layers.0.mlp.experts.down_proj"],
        model.state_dict()["model.layers.0.mlp.experts.down_proj"],
    )  # the experts are the quantized ones


def test_gpt_oss_config_and_mxfp4_layout(gpt_oss_files: Any) -> None:
    """The config comes from the metadata (and what llama.cpp fixes); MXFP4 experts are kept
    as MXFP4 (17 bytes per 32 values, as stored) and each transcoded matrix decodes to exactly
    gguf's dequantization of the expert's stored blocks."""
    path, ref = gpt_oss_files["gpt_oss-mxfp4"]
    config, _, layout = open_gguf(path)
    want = ref.config
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
        "sliding_window", "layer_types", "max_position_embeddings",
        "swiglu_limit", "swiglu_alpha", "vocab_size", "tie_word_embeddings",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(want, key), key
    assert config.rms_norm_eps == float(np.float32(want.rms_norm_eps))  # stored as float32
    assert config.rope_parameters == want.rope_parameters
    packing = layout.packing(torch.float32)
    per_matrix = GPT_OSS_I * GPT_OSS_D // 32 * 17
    assert packing.name == "mxfp4" and packing.nbytes == 3 * per_matrix
    assert layout.source_bytes(1, 5) == 3 * per_matrix
    row = torch.zeros(packing.numel, dtype=torch.uint8)
    assert layout.read_into(1, 5, row) == 3 * per_matrix
    fmt = packing.formats[1]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    dims = {
        "gate": (GPT_OSS_I, GPT_OSS_D),
        "up": (GPT_OSS_I, GPT_OSS_D),
        "down": (GPT_OSS_D, GPT_OSS_I),
    }
    mats = []
    for part, raw in zip(("gate", "up", "down"), fmt.parts(row)):
        t = tensors[f"blk.1.ffn_{part}_exps.weight"]
        assert t.tensor_type == T.MXFP4 and raw.numel() == t.data[5].size == per_matrix
        want_values = torch.from_numpy(gguf.quants.dequantize(t.data[5], T.MXFP4).copy())
        got = MXFP4.decode(raw, *dims[part], torch.float32)
        assert torch.equal(got, want_values), part
        mats.append(got)
    gate_up, down = fmt.split(row)
    assert torch.equal(gate_up, torch.cat(mats[:2])) and torch.equal(down, mats[2])


@pytest.mark.parametrize(
    "key",
    ["attention.sliding_window", "expert_feed_forward_length", "rope.scaling.factor"],
)
def test_gpt_oss_missing_metadata_key_named(tmp_path: Path, key: str) -> None:
    path = tmp_path / "gpt-oss-tiny.gguf"
    write_gpt_oss_gguf(tiny_hf_model("gpt_oss"), path, T.Q8_0, skip=key)
    with pytest.raises(
        CheckpointError,
        match=rf"gpt-oss-tiny\.gguf: metadata key gpt-oss\.{re.escape(key)} is missing",
    ):
        open_gguf(path)


# gpt-oss's tokenizer.json pre-tokenizer (o200k): the split llama.cpp names "gpt-4o"
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_gpt_oss_tokenizer_from_the_file(tmp_path: Path) -> None:
    """A gpt-oss GGUF's tokenizer (byte-level BPE, pre-tokenizer "gpt-4o", chat template) is
    built from the file (AutoTokenizer cannot: transformers' GGUF config mapping fails on
    gpt-oss's rope.scaling keys first) and encodes as the HF tokenizer does, digits split in
    threes: a merge across a split ("3 4") applies only where the split is wrong."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moetier.llm import load_tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("3", "4"), ("1", "2"), ("12", "3")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<|start|>", "<|end|>", "<|return|>"])
    template = "{% for m in messages %}<|start|>{{ m['role'] }}<|end|>{% endfor %}"
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|return|>")
    path = tmp_path / "gpt-oss.gguf"
    model = tiny_hf_model("gpt_oss", vocab_size=len(tok))
    write_gpt_oss_gguf(model, path, T.Q8_0, tokenizer=tok, chat_template=template)
    got = load_tokenizer(path)
    assert got is not None and got.chat_template == template
    text = "<|start|>user 12345 it's<|end|>"
    assert got.encode(text) == tok.encode(text)
    assert tok.encode("12345") == [vocab["123"], vocab["4"], vocab["5"]]
    assert got.eos_token == "<|return|>"
