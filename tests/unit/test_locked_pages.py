"""The host tier's page-locked memory, with CUDA's register calls faked so it runs on the CPU:
registered once for exactly its size, unregistered exactly once when the last tensor over the
memory is freed (not when the first tensor object goes), and a failed registration falls back
to pin_memory() with a warning."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from moetier.offload import store
from moetier.offload.store import LockedPages, alloc_host_rows


class FakeCudart:
    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.calls: list[tuple[Any, ...]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, size, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: fake.calls.append(("sync",)))
    return fake


def test_rows_are_registered_for_exactly_their_size(cudart: FakeCudart) -> None:
    buf, pinned = alloc_host_rows(3, 1000, torch.bfloat16, pin=True)
    assert buf.shape == (3, 1000) and buf.dtype == torch.bfloat16
    assert pinned == 6000
    assert cudart.calls == [("register", buf.data_ptr(), 6000, 0)]
    assert buf.data_ptr() % 4096 == 0  # page-aligned
    buf[2].fill_(1.5)
    assert float(buf.float().sum()) == 1500.0


def test_unregistered_once_when_the_last_view_dies(cudart: FakeCudart) -> None:
    buf, _ = alloc_host_rows(2, 512, torch.float32, pin=True)
    ptr = buf.data_ptr()
    row = buf[1]
    del buf
    gc.collect()
    assert cudart.calls == [("register", ptr, 4096, 0)]  # the view still holds the memory
    row.fill_(2.0)
    del row
    gc.collect()
    assert cudart.calls == [("register", ptr, 4096, 0), ("sync",), ("unregister", ptr)]


def test_failed_registration_falls_back_with_a_warning(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cudart.register_error = 712  # cudaErrorHostMemoryAlreadyRegistered
    pinned_calls = []

    def fake_empty(*shape: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
        pinned_calls.append(pin_memory)
        return torch.zeros(*shape, dtype=dtype)

    monkeypatch.setattr(store.torch, "empty", fake_empty)
    with caplog.at_level(logging.WARNING, logger="moetier.offload.store"):
        buf, pinned = alloc_host_rows(2, 256, torch.float32, pin=True)
    assert buf.shape == (2, 256) and pinned == 2048
    assert pinned_calls[-1] is True
    assert "cudaError 712" in caplog.text and "pin_memory()" in caplog.text
    assert [c[0] for c in cudart.calls] == ["register"]  # nothing to unregister


def test_no_pinning_asked_registers_nothing(cudart: FakeCudart) -> None:
    buf, pinned = alloc_host_rows(2, 8, torch.float32, pin=False)
    assert pinned == 0 and buf.shape == (2, 8) and cudart.calls == []
    pages = LockedPages(4096)
    del pages
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register", "sync", "unregister"]
