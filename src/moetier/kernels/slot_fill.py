"""Copies chosen host-tier rows into chosen device slots, with the choice on the device.

`fill_slots(host_pool, pool, src, dst)`: for every i with src[i] >= 0, pool[dst[i]] =
host_pool[src[i]]. On CUDA a Triton kernel reads the page-locked host rows in place (mapped into
the device's address space), so the ids never leave the device and the fill can sit inside a
CUDA graph; elsewhere (the CPU path, and Triton's interpreter in tests) PyTorch indexing or the
same kernel interpreted does it.
"""

from __future__ import annotations

import torch

from moetier.kernels.expert_ffn import kernel_ok

# Words per program: a 9.4 MB expert row is ~290 programs of 4096 int64 words (the copy needs
# >= 16 programs in flight to reach the link's rate: shared/facts.md).
BLOCK_WORDS = 4096


def _words(t: torch.Tensor) -> torch.Tensor:
    """t [R, row] as 8-byte words when its rows allow (fewer, wider loads), else as is."""
    row_bytes = t.shape[1] * t.element_size()
    if row_bytes % 8 == 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 8 == 0:
        return t.view(torch.int64) if t.element_size() != 8 else t
    return t


def fill_slots(
    host_pool: torch.Tensor, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """pool[dst[i]] = host_pool[src[i]] where src[i] >= 0 (src, dst [N] int64 on pool's
    device; the rows must have the same length and dtype)."""
    if not kernel_ok(pool):
        sel = src >= 0
        rows = host_pool[src[sel].to(host_pool.device)]
        pool[dst[sel]] = rows.to(pool.device, non_blocking=True)
        return
    from moetier.kernels._slot_fill_triton import fill_slots_triton

    fill_slots_triton(_words(host_pool), _words(pool), src, dst, BLOCK_WORDS)
