"""Engine parity on Mixtral: a batch equals each prompt alone; chunked prefill equals whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier import LLM
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS, moetier_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["mixtral"].checkpoint(tmp_path_factory.mktemp("mixtral"))


def test_batch_of_different_lengths_equals_each_alone(ckpt: Path) -> None:
    llm = LLM(str(ckpt), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    together = moetier_greedy(llm, PROMPTS)
    alone = [moetier_greedy(llm, [p])[0] for p in PROMPTS]
    assert together == alone


def test_chunked_prefill_equals_whole_prefill(ckpt: Path) -> None:
    whole = LLM(str(ckpt), device="cpu", dtype="float32", progress=False)
    chunked = LLM(
        str(ckpt),
        expert_budget="25%",
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=4,
        progress=False,
    )
    assert moetier_greedy(chunked, PROMPTS) == moetier_greedy(whole, PROMPTS)
