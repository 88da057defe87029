"""Device out-of-memory at start-up: turns the allocator's error into a DeviceMemoryError.

Owns the wording (what was asked, what the device had free, which setting to lower); allocates
nothing itself and never retries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from moetier.config import format_bytes
from moetier.errors import DeviceMemoryError

T = TypeVar("T")


def free_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device as the driver sees them (other processes count);
    None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def held_by_us(device: torch.device) -> int:
    """Bytes this process's tensors hold on `device` (0 off CUDA)."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def allocate(
    device: torch.device,
    build: Callable[[], T],
    what: str,
    asked: Callable[[], int],
    fix: Callable[[tuple[int, int] | None], str],
) -> T:
    """`build()`, or a DeviceMemoryError if the device runs out of memory during it.

    The error names `what` was being placed, `asked()` bytes, the device's free and total bytes
    before `build` started, and `fix(free_total)`: the setting to lower. It is raised outside
    the `except` block so that it does not chain the allocator's error, whose traceback would
    keep the half-built tensors alive for as long as the caller keeps the error.
    """
    before = free_memory(device)
    held = held_by_us(device)
    try:
        return build()
    except torch.OutOfMemoryError as exc:
        # "CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has ...": the first two
        detail = ". ".join(str(exc).strip().split(". ")[:2]) or type(exc).__name__
    raise DeviceMemoryError(
        f"device {device} out of memory placing {what}: needs {format_bytes(asked())}, "
        f"{_free_text(before, held)} (allocator: {detail}). {fix(before)}"
    )


def _free_text(free_total: tuple[int, int] | None, held: int) -> str:
    if free_total is None:
        return "free device memory unknown"
    free, total = free_total
    text = f"the device had {format_bytes(free)} free of {format_bytes(total)}"
    if held:
        text += f", moetier already holding {format_bytes(held)}"
    return text
