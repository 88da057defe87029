"""Device out-of-memory at start-up, injected on the CPU (the allocation raises
torch.OutOfMemoryError): the error names what was being placed, the bytes asked, the device's
free memory, and the setting to lower; nothing half-built stays alive; `moetier serve` exits 2
with that one line and no traceback. tests/gpu/test_gpu_oom.py runs out for real on CUDA."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import moetier.device_memory
import moetier.engine.kv_cache
import moetier.engine.model_runner
import moetier.llm
import moetier.offload.builder
from moetier import LLM
from moetier.config import format_bytes
from moetier.errors import DeviceMemoryError
from moetier.weights.checkpoint import Checkpoint

MiB = 1 << 20
FREE, TOTAL = 1 * MiB, 80 << 30  # what the injected device reports: less than the experts
TORCH_OOM = "CUDA out of memory. Tried to allocate 1.69 MiB. GPU 0 has a total capacity of 80 GiB"

# Loaded by every interpreter the server starts (the engine is a spawned process) when
# MOETIER_TEST_OOM is set: the expert slot pool raises as CUDA would, with FREE bytes free.
SITECUSTOMIZE = f"""
import os
if os.environ.get("MOETIER_TEST_OOM"):
    import torch
    import moetier.device_memory
    import moetier.offload.builder

    def _oom(*args, **kwargs):
        raise torch.OutOfMemoryError({TORCH_OOM!r})

    moetier.offload.builder.ExpertCache = _oom
    moetier.device_memory.free_memory = lambda device: ({FREE}, {TOTAL})
"""


def _oom(*args: Any, **kwargs: Any) -> Any:
    raise torch.OutOfMemoryError(TORCH_OOM)


@pytest.fixture
def device_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moetier.device_memory, "free_memory", lambda device: (FREE, TOTAL))


def _sizes(model: Path) -> tuple[int, int]:
    """(routed-expert bytes, non-expert bytes) of the float32 checkpoint, from its headers."""
    ckpt = Checkpoint(model)
    try:
        infos = list(ckpt.tensors.values())
    finally:
        ckpt.close()
    routed = sum(t.nbytes for t in infos if ".experts." in t.name)
    return routed, sum(t.nbytes for t in infos) - routed


def _build_fails(model: Path, **kw: Any) -> str:
    """The DeviceMemoryError's message; the error is gone once this returns (as in a caller that
    reports it and retries with a smaller budget)."""
    try:
        LLM(str(model), device="cpu", dtype="float32", progress=False, **kw)
    except DeviceMemoryError as exc:
        assert exc.__context__ is None and exc.__cause__ is None  # no half-built state chained
        return str(exc)
    raise AssertionError("no DeviceMemoryError")


def test_expert_slots_oom_names_budget_and_numbers(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, device_free: None
) -> None:
    built: list[weakref.ref[torch.nn.Module]] = []
    real_build = moetier.engine.model_runner.build_model

    def build_model(*args: Any, **kwargs: Any) -> Any:
        model = real_build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(moetier.engine.model_runner, "build_model", build_model)
    monkeypatch.setattr(moetier.offload.builder, "ExpertCache", _oom)
    routed, _ = _sizes(tiny_model)
    message = _build_fails(tiny_model, expert_budget="100%")
    assert "device cpu out of memory placing 24 expert slots of 72.00 KiB" in message, message
    assert f"needs {format_bytes(routed)}" in message, message
    assert "the device had 1.00 MiB free of 80.00 GiB" in message, message
    assert "Lower --expert-budget (LLM(expert_budget=...)), now '100%'" in message, message
    assert f"at most 1.00 MiB ({100 * MiB / routed:.0f}% of the" in message, message
    assert "Tried to allocate 1.69 MiB" in message, message
    gc.collect()
    assert len(built) == 1 and built[0]() is None, "the half-built model's weights stayed alive"


def test_default_budget_is_named_too(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, device_free: None
) -> None:
    monkeypatch.setattr(moetier.offload.builder, "ExpertCache", _oom)
    message = _build_fails(tiny_model)
    assert "now all experts (the default)" in message, message


def test_non_expert_weights_oom_names_model_and_dtype(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, device_free: None
) -> None:
    monkeypatch.setattr(moetier.engine.model_runner, "build_model", _oom)
    _, non_expert = _sizes(tiny_model)
    message = _build_fails(tiny_model, expert_budget="25%")
    assert f"placing the non-expert weights of {tiny_model} in float32" in message, message
    assert f"needs {format_bytes(non_expert)}" in message, message
    assert "the device had 1.00 MiB free of 80.00 GiB" in message, message
    assert "whatever the budgets" in message and "--dtype" in message, message


def test_other_start_up_oom_names_the_memory_settings(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moetier.llm, "Engine", _oom)
    message = _build_fails(tiny_model, expert_budget="50%")
    assert "out of memory while building the engine" in message, message
    assert "Tried to allocate 1.69 MiB" in message, message
    for flag in ("--expert-budget (now 50%)", "--num-kv-blocks", "--max-num-seqs"):
        assert flag in message, message


def test_serve_exits_2_with_one_line(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in [str(tmp_path), os.environ.get("PYTHONPATH")] if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOETIER_TEST_OOM": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "moetier", "serve", str(tiny_model), "--device", "cpu"]
    cmd += ["--port", "0", "--expert-budget", "100%"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("moetier: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    for part in ("out of memory placing 24 expert slots", "1.00 MiB free", "--expert-budget"):
        assert part in errors[0], errors[0]


def test_kv_pools_exist_right_after_construction(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", progress=False, num_kv_blocks=4)
    kv = llm.engine.runner.kv_cache
    layers = sorted(kv.layout)
    assert layers and sorted(kv._k) == layers and sorted(kv._v) == layers  # before any request
    assert kv.bytes() == 4 * 16 * kv.bytes_per_token == llm.offload_stats()["kv_cache_bytes"]


def test_kv_cache_that_cannot_fit_fails_at_start_up(tiny_model: Path) -> None:
    """Checked against the memory available before anything is allocated (on the CPU the
    host's MemAvailable), so an impossible block count never touches the allocator."""
    per_token = LLM(
        str(tiny_model), device="cpu", dtype="float32", progress=False, num_kv_blocks=1
    ).offload_stats()["kv_bytes_per_token"]
    blocks = 10**12
    message = _build_fails(tiny_model, num_kv_blocks=blocks)
    asked = blocks * 16 * per_token
    assert f"device cpu cannot hold the KV cache ({blocks} blocks of 16 tokens" in message
    assert f"{per_token} B/token as fp32" in message, message
    assert f"needs {format_bytes(asked)} ({asked} B)" in message, message
    assert f"Lower --num-kv-blocks (LLM(num_kv_blocks=...)), now {blocks}" in message, message
    assert "--kv-cache-dtype int8" in message, message


def test_kv_cache_oom_names_the_kv_settings(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, device_free: None
) -> None:
    """The allocator running out while the pools are placed (CUDA) is explained the same way."""
    monkeypatch.setattr(moetier.engine.kv_cache, "PagedKVCache", _oom)
    message = _build_fails(tiny_model, kv_cache_dtype="int8")
    assert "device cpu out of memory placing the KV cache (" in message, message
    assert "B/token as int8)" in message and "the device had 1.00 MiB free" in message, message
    assert "Lower --max-num-seqs (now 64) or --max-model-len" in message, message
    assert "--kv-cache-dtype int8" not in message, message  # already int8
