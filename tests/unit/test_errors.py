"""Bad inputs give clear errors that name the file or setting and say what to do."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from moetier import LLM, SamplingParams
from moetier.errors import BudgetError, CheckpointError, ConfigError, UnsupportedModelError
from tests.models.families import MICRO_MIXTRAL
from tests.models.parity import make_checkpoint

TINY = MICRO_MIXTRAL


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("good"), "mixtral", **TINY)


def _copy(good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", progress=False, **kw)  # type: ignore[arg-type]


def test_missing_shard_names_the_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_checkpoint(tmp_path / "a", "mixtral", **TINY))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shards[1].name}"):
        _llm(tmp_path / "sharded")


def test_truncated_file_says_truncated(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path)
    f = path / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: tensor .* the file is truncated"
    ):
        _llm(path)


def test_garbage_header(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        _llm(path)


def test_unknown_architecture_lists_supported(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*MixtralForCausalLM"):
        _llm(path)


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        _llm(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        _llm(tmp_path)


def test_budget_too_small_says_minimum(good: Path) -> None:
    with pytest.raises(BudgetError, match=r"needs at least top-k = 2 slots \(9.00 KiB, 25.00%"):
        _llm(good, expert_budget="1KiB")


def test_bad_device_dtype_and_prompts(good: Path) -> None:
    with pytest.raises(ConfigError, match="unknown dtype"):
        LLM(str(good), device="cpu", dtype="float8", progress=False)
    with pytest.raises(ConfigError, match="device"):
        LLM(str(good), device="tpu", progress=False)
    llm = _llm(good)
    with pytest.raises(ConfigError, match=r"out of range \[0, 32\)"):
        llm.generate([[1, 2, 99]])
    with pytest.raises(ConfigError, match="empty"):
        llm.generate([[1, 2], []])
    assert not llm.engine.has_unfinished()  # the good prompt of a rejected batch was not queued
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # the engine is still usable after rejected requests
    assert (
        len(
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0]
            .outputs[0]
            .token_ids
        )
        == 2
    )
