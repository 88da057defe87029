"""Device-time parsing of profiler events (the CUDA path, fed fake events on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.autograd import DeviceType

from moetier.bench import profiling


def _evt(name: str, device: DeviceType, us: float, annotation: bool = False) -> Any:
    return SimpleNamespace(
        name=name,
        device_type=device,
        is_user_annotation=annotation,
        time_range=SimpleNamespace(elapsed_us=lambda: us),
    )


class _FakeProfile:
    def __init__(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _FakeProfile:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def events(self) -> list[Any]:
        return [
            _evt("aten::mm", DeviceType.CPU, 500.0),  # host op: not device time
            _evt("ampere_gemm", DeviceType.CUDA, 300.0),
            _evt("elementwise_kernel", DeviceType.CUDA, 100.0),
            _evt("ampere_gemm", DeviceType.CUDA, 60.0),
            _evt("Memcpy HtoD (Pinned -> Device)", DeviceType.CUDA, 250.0),
            _evt("Memset (Device)", DeviceType.CUDA, 50.0),
            _evt("moetier_step", DeviceType.CUDA, 9000.0, annotation=True),
        ]


def test_kernel_time_and_launches_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []
    res = profiling.profile_steps(lambda: calls.append(1), steps=2)
    assert len(calls) == 2
    assert res.kernel_ms_per_step == pytest.approx(0.23)  # (300 + 100 + 60) us / 2 steps
    assert res.launches_per_step == 1.5
    assert res.copy_ms_per_step == pytest.approx(0.15)
    # heaviest first: (name, ms per step, launches per step)
    assert [k[0] for k in res.top_kernels] == ["ampere_gemm", "elementwise_kernel"]
    assert res.top_kernels[0][1:] == pytest.approx((0.18, 1.0))
    assert res.top_kernels[1][1:] == pytest.approx((0.05, 0.5))
