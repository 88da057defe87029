"""FP8 e4m3 checkpoints with block scales: experts stay FP8 in every tier (bytes counted as
stored) and are decoded where computed; greedy tokens equal transformers on the checkpoint's
exact dequantization, at 100%, 50% and the minimum budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout
from moetier.weights.formats import FP8_BLOCK, ExpertFormat, ExpertShape, Fp8BlockCodec
from tests.models.families import FAMILIES
from tests.models.fp8 import make_fp8, quantize_blocks
from tests.models.parity import check_parity, text_config, top_k

BLOCK = (16, 16)


def _fp8_pair(tmp_path: Path, model_type: str, **overrides: object) -> tuple[Path, Path]:
    src = FAMILIES[model_type].checkpoint(tmp_path / "src", **overrides)
    make_fp8(src, tmp_path / "fp8", tmp_path / "ref", BLOCK)
    return tmp_path / "fp8", tmp_path / "ref"


def _expert_bytes(path: Path) -> int:
    cfg = text_config(path)
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    codec = Fp8BlockCodec(BLOCK)
    fmt = ExpertFormat(ExpertShape(cfg["hidden_size"], inter), torch.float32, (codec,) * 3)
    return fmt.nbytes


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_qwen3_fp8_matches_dequantized_reference(tmp_path: Path, budget: str | None) -> None:
    # I = 40 with 16x16 blocks: gate/up end in an 8-row block, down in an 8-column one.
    fp8, ref = _fp8_pair(tmp_path, "qwen3_moe", moe_intermediate_size=40)
    nbytes = _expert_bytes(fp8)
    if budget == "min":
        budget = f"{top_k(text_config(fp8)) * nbytes}B"
    stats = check_parity(fp8, budget, reference=ref)
    assert stats["expert_format"] == "fp8_e4m3_b16x16"
    assert stats["expert_bytes"] == nbytes
    # values 1 byte each + float32 scales of 16x16 blocks, each part 16-byte aligned
    d, i = 64, 40
    scales = 4 * (2 * (3 * 4) + 4 * 3)
    assert nbytes == 3 * d * i + scales


def test_deepseek_v3_fp8_partial_blocks(tmp_path: Path) -> None:
    # kv_a_proj_with_mqa has kv_lora_rank + qk_rope_head_dim = 40 rows: a partial last block,
    # dequantized at load like every non-expert FP8 weight.
    fp8, ref = _fp8_pair(tmp_path, "deepseek_v3")
    ckpt = Checkpoint(fp8)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert ckpt.info(name).dtype == torch.float8_e4m3fn and ckpt.info(name).shape[0] == 40
    check_parity(fp8, "50%", reference=ref)


def test_codec_decodes_what_it_encodes() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g)
    codec = Fp8BlockCodec(BLOCK)
    values, scale = quantize_blocks(w, BLOCK)
    raw = codec.encode(values, scale)
    assert raw.numel() == codec.nbytes(40, 72) == 48 * 0 + 40 * 72 + 4 * 3 * 5
    got = codec.decode(raw, 40, 72, torch.float32)
    full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :72]
    assert torch.equal(got, values.float() * full)
    assert torch.equal(codec.decode(raw, 40, 72, torch.bfloat16), got.to(torch.bfloat16))
    assert FP8_BLOCK.name == "fp8_e4m3" and FP8_BLOCK.block == (128, 128)


def test_codec_rejects_wrong_scale_shape() -> None:
    codec = Fp8BlockCodec(BLOCK)
    values, _ = quantize_blocks(torch.randn(40, 72), BLOCK)
    with pytest.raises(ValueError, match=r"needs \(3, 5\)"):
        codec.encode(values, torch.ones(2, 5))


def test_layout_packs_fp8_experts_as_stored(tmp_path: Path) -> None:
    fp8, ref = _fp8_pair(tmp_path, "qwen3_moe", moe_intermediate_size=40)
    layout = ExpertLayout(Checkpoint(fp8), {1: ["model.layers.1.mlp"]}, 8, fp8_block=BLOCK)
    packing = layout.packing(torch.float32)
    assert packing.compressed and packing.storage_dtype == torch.uint8
    row = torch.zeros(packing.numel, dtype=torch.uint8)
    read = layout.read_into(1, 5, row)
    assert read == layout.source_bytes(1, 5)
    gate_up, down = packing.splitter(1)(row)
    ref_ckpt = Checkpoint(ref)
    p = "model.layers.1.mlp.experts.5"
    gate, up = (ref_ckpt.read(f"{p}.{n}.weight") for n in ("gate_proj", "up_proj"))
    assert torch.equal(gate_up, torch.cat([gate, up]))
    assert torch.equal(down, ref_ckpt.read(f"{p}.down_proj.weight"))


def test_fp8_experts_without_scales_are_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from moetier.errors import CheckpointError

    fp8, _ = _fp8_pair(tmp_path, "qwen3_moe")
    tensors = load_file(str(fp8 / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.0\.up_proj\.weight has no .*_scale_inv"):
        ExpertLayout(Checkpoint(fp8), {1: ["model.layers.1.mlp"]}, 8)


@pytest.mark.parametrize(
    ("budget", "kernels"),
    [
        (None, dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=0)),
        ("50%", dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=0)),
        ("50%", dict(moe_grouped_kernel=False, moe_slot_kernel_max_pairs=128)),
    ],
)
def test_fp8_kernel_path_parity(tmp_path: Path, budget: str | None, kernels: dict) -> None:
    # The kernel path reads FP8 slots in place (its PyTorch reference on the CPU: the Triton
    # kernels themselves are checked in tests/unit/test_fp8_kernels.py).
    fp8, ref = _fp8_pair(tmp_path, "qwen3_moe", moe_intermediate_size=40)
    stats = check_parity(fp8, budget, reference=ref, **kernels)
    if budget is None:
        assert stats["resident_lookups"] > 0 and stats["requests"] == 0
    else:
        assert stats["requests"] > 0
