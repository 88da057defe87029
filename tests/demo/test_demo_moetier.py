"""The demo checkpoint through moetier itself, experts tiered down to disk on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetier import LLM, SamplingParams
from tests.demo.conftest import KNOWN_ANSWERS, MAX_NEW_TOKENS

pytestmark = pytest.mark.slow


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def test_moetier_greedy_equals_dense_with_disk_reads(
    demo_model: Path,
    prompt_ids: dict[str, list[int]],
    dense_reference: dict[str, list[int]],
    demo_tokenizer: Any,
    cores: None,
) -> None:
    """moetier's greedy tokens equal the dense SmolLM2's (see dense_reference) while a quarter
    of the experts fit the device tier and a tenth the host tier, so experts come from disk.

    Both sides are compared without a final EOS token (whether it is listed is API detail).
    """
    llm = LLM(
        str(demo_model), expert_budget="25%", host_budget="10%", device="cpu", dtype="float32"
    )
    questions = [q for q, _ in KNOWN_ANSWERS]
    outs = llm.generate(
        [prompt_ids[q] for q in questions],
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
    )
    eos = int(demo_tokenizer.eos_token_id)
    for question, out in zip(questions, outs):
        completion = out.outputs[0]
        assert _strip_eos(list(completion.token_ids), eos) == _strip_eos(
            dense_reference[question], eos
        ), question
    assert "Paris" in outs[0].outputs[0].text
    assert llm.offload_stats()["disk_reads"] > 0


def test_cli_generate_defaults_to_demo(
    demo_home: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cores: None,
) -> None:
    """`moetier generate` with no --model uses the (already built) demo and answers."""
    from moetier.cli import main

    monkeypatch.setenv("MOETIER_HOME", str(demo_home))
    rc = main(["generate", "--max-tokens", "12", "--expert-budget", "25%", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith("The capital of France is Paris")
    assert "120/480 slots" in err and "disk" in err
