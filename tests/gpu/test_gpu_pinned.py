"""The pinned host tier on CUDA: exactly its budget page-locked, for as long as its memory lives.

- `alloc_host_rows` locks rows x row bytes with cudaHostRegister; PyTorch's caching host
  allocator (which rounds a block up to a power of two) does not grow by it.
- The registration ends with the memory, not with one tensor object: a row view that outlives
  the buffer's tensor keeps the pages registered; once the last view is gone the pages are
  unregistered, and buffers allocated after it (often at the same address) register and copy
  again. An earlier version tied it to the tensor object and failed here with `invalid
  argument` after several engines in one process.
- An engine built with a host budget locks what the budget says (within one expert).

Run on the GPU machine with `bash scripts/gpu_session.sh` (or `pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from moetier import LLM
from moetier.config import parse_budget
from moetier.offload.store import LockedPages, alloc_host_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_KEY = "allocated_bytes.current"


def _host_alloc() -> int:
    return int(torch.cuda.host_memory_stats().get(_KEY, 0))


def _copied(row: torch.Tensor, value: float) -> bool:
    row.fill_(value)
    dst = torch.empty(row.numel(), dtype=row.dtype, device="cuda")
    dst.copy_(row, non_blocking=True)
    torch.cuda.synchronize()
    return bool((dst == value).all())


def test_alloc_host_rows_locks_exactly_its_size() -> None:
    torch.cuda.init()
    rows, numel = 3, (17 << 20) // 6  # 17 MiB of bf16: a power-of-two rounding would take 32
    before = _host_alloc()
    buf, pinned = alloc_host_rows(rows, numel, torch.bfloat16, pin=True)
    assert pinned == rows * numel * 2 and buf.is_pinned() and buf[1].is_pinned()
    assert buf.shape == (rows, numel) and buf.dtype == torch.bfloat16
    grown = _host_alloc() - before
    assert grown < (1 << 20), f"the caching host allocator grew by {grown} bytes"
    assert _copied(buf[1], 3.0)
    probe = torch.empty(rows * numel, dtype=torch.bfloat16, pin_memory=True)
    rounded = _host_alloc() - before - grown
    print(f"pin_memory() of {probe.numel() * 2} bytes took {rounded} from the caching allocator")


def test_registration_lives_exactly_as_long_as_the_memory() -> None:
    torch.cuda.init()
    numel = (5 << 20) // 2
    ptrs = []
    for round_ in range(4):  # buffers come and go; later ones often reuse an address
        pages = LockedPages(2 * numel * 2)  # raises if its range were still registered
        alive = weakref.ref(pages)
        buf = pages.tensor(torch.bfloat16).view(2, numel)
        ptrs.append(buf.data_ptr())
        row = buf[1]  # a view that outlives the buffer's tensor and the pages object's name
        del pages, buf
        gc.collect()
        assert alive() is not None and row.is_pinned(), f"round {round_}: freed under a view"
        assert _copied(row, float(round_ + 1))
        del row
        gc.collect()
        assert alive() is None, f"round {round_}: the pages outlived their last tensor"
    print(f"addresses: {[hex(p) for p in ptrs]}")
    # the same through alloc_host_rows, as engines coming and going use it
    for round_ in range(3):
        before = _host_alloc()
        buf, _ = alloc_host_rows(2, numel, torch.bfloat16, pin=True)
        assert buf.is_pinned() and _host_alloc() == before, f"round {round_}: fell back"
        assert _copied(buf[0], -float(round_ + 1))
        del buf
        gc.collect()


def test_pinned_host_tier_matches_host_budget(ckpt: Path) -> None:
    torch.cuda.init()
    before = _host_alloc()
    llm = LLM(
        str(ckpt), expert_budget="25%", host_budget="50%", device="cuda", dtype="bfloat16",
        progress=False,
    )  # fmt: skip
    grown = _host_alloc() - before
    runner = llm.engine.runner
    plan, host = runner.tier_plan, runner.expert_cache.host
    allowed = parse_budget("50%", plan.routed_bytes)
    locked = host.pinned_bytes + grown  # what the host tier (and anything else) page-locked
    assert host.pinned_bytes == plan.host_rows * plan.expert_bytes and host.pool.is_pinned()
    assert allowed - plan.expert_bytes < host.pinned_bytes <= allowed
    assert locked <= allowed + (64 << 10), (locked, allowed, grown)
