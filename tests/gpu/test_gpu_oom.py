"""Device out-of-memory at start-up on CUDA, for real: with all but LEAVE bytes of the free
device memory taken by one tensor, a 100% expert budget fails with a DeviceMemoryError that names
the budget, the bytes asked and the bytes free; the failed build leaves nothing allocated; once the
tensor is freed the same checkpoint builds at 100% and at 25% and both give the same greedy tokens.

Run on the GPU machine with `bash scripts/gpu_check.sh`; tests/reliability/test_startup_oom.py
injects the same failure on the CPU.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from moetier import LLM
from moetier.config import format_bytes
from moetier.errors import DeviceMemoryError
from tests.models.parity import PROMPTS, make_checkpoint, moetier_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1 << 20
# Routed experts: 4 layers x 8 experts x 3 x 256 x 4096 x 4 bytes = 384 MiB in float32; the
# non-expert weights are about 4 MiB.
SHAPE = dict(
    hidden_size=256,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=256,
    max_position_embeddings=256,
)
EXPERT_BYTES = 3 * 256 * 4096 * 4
ROUTED = 4 * 8 * EXPERT_BYTES
LEAVE = 128 * MiB  # left free: room for the non-expert weights, not for the 384 MiB slot pool
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}


@pytest.fixture(scope="module")
def big_experts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("oom") / "mixtral", "mixtral", 0, **SHAPE)


def _llm(path: Path, budget: str) -> LLM:
    return LLM(str(path), expert_budget=budget, device="cuda", dtype="float32", progress=False)


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def test_expert_slots_that_do_not_fit_then_smaller_budget_works(big_experts: Path) -> None:
    # cuBLAS keeps a workspace from its first matmul on; make it now so it is not counted below.
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    assert free > ROUTED + 2 * LEAVE, f"only {format_bytes(free)} free: nothing to test"
    hog = torch.empty(free - LEAVE, dtype=torch.uint8, device="cuda")
    with_hog = torch.cuda.memory_allocated()

    message = None
    try:
        _llm(big_experts, "100%")
    except DeviceMemoryError as exc:
        message = str(exc)  # only the text leaves the except block: the error is freed here
    assert message is not None, "a 384 MiB slot pool fit beside the hog: nothing was tested"
    print(message)
    assert "out of memory placing 32 expert slots of 12.00 MiB" in message, message
    assert f"needs {format_bytes(ROUTED)}" in message, message
    assert "Lower --expert-budget (LLM(expert_budget=...)), now '100%'" in message, message
    assert "CUDA out of memory" in message, message
    had = re.search(r"the device had ([\d.]+ [KMG]?i?B) free of ([\d.]+ [KMG]?i?B)", message)
    assert had is not None, message
    assert 0 < _bytes(had.group(1)) <= LEAVE + 4 * MiB, message  # what the hog left, less weights
    assert f"at most {had.group(1)}" in message, message

    gc.collect()
    torch.cuda.synchronize()
    leaked = torch.cuda.memory_allocated() - with_hog
    assert leaked == 0, f"the failed build left {format_bytes(leaked)} allocated"

    del hog
    torch.cuda.empty_cache()
    full = _llm(big_experts, "100%")
    want = moetier_greedy(full, PROMPTS[:2])
    assert full.offload_stats()["device_slots"] == 32
    del full
    gc.collect()
    quarter = _llm(big_experts, "25%")
    assert quarter.offload_stats()["device_slots"] == 8
    assert moetier_greedy(quarter, PROMPTS[:2]) == want
