"""Fixtures of the demo-model tests: one demo build per session and the dense reference.

Set MOETIER_TEST_DEMO_HOME to a directory to keep the build between local runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# (chat prompt, text the greedy answer must contain); checked against the dense model
KNOWN_ANSWERS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is 2 + 2?", "is 4"),
    ("What is the chemical symbol for gold?", "Au"),
]
MAX_NEW_TOKENS = 24


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """The demo build and 135M-parameter forwards want every core (the suite pins one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kept = os.environ.get("MOETIER_TEST_DEMO_HOME")
    if kept:
        return Path(kept)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one build for all workers (`ensure_demo_model` locks the directory while it builds)
        shared = tmp_path_factory.getbasetemp().parent / "moetier_home"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("moetier_home")


@pytest.fixture(scope="session")
def demo_model(demo_home: Path) -> Path:
    from moetier.demo.builder import ensure_demo_model

    with all_cores():
        return ensure_demo_model(demo_home, progress=False)


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model))


@pytest.fixture(scope="session")
def prompt_ids(demo_tokenizer: Any) -> dict[str, list[int]]:
    """Chat-template token ids of each known-answer prompt."""
    from moetier.demo.calibration import chat_prompt_ids

    return {q: chat_prompt_ids(demo_tokenizer, q) for q, _ in KNOWN_ANSWERS}


@pytest.fixture(scope="session")
def dense_reference(demo_home: Path, prompt_ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy answer ids (up to MAX_NEW_TOKENS, EOS kept) of the dense SmolLM2 per prompt.

    Dense = the source GGUF loaded by transformers, weights rounded to bfloat16 (what the demo
    checkpoint stores) and computed in float32.
    """
    from transformers import AutoModelForCausalLM

    from moetier.demo.source import ensure_source_gguf, round_to_bfloat16_
    from moetier.demo.verify import greedy_ids

    gguf = ensure_source_gguf(demo_home)
    with all_cores():
        dense = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        round_to_bfloat16_(dense)
        return {q: greedy_ids(dense, ids, MAX_NEW_TOKENS) for q, ids in prompt_ids.items()}


@pytest.fixture(scope="session")
def moe_model(demo_model: Path) -> Any:
    """The demo checkpoint through transformers' AutoModelForCausalLM, in float32."""
    from moetier.demo.verify import load_float32

    with all_cores():
        return load_float32(demo_model)


@pytest.fixture
def cores() -> Iterator[None]:
    with all_cores():
        yield
