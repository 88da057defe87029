"""Link bandwidth measured at the start of a bench run: the denominator of the bound.

Owns the measurement only. CUDA: pinned host->device copies (through transfer.measure_raw) at
16 MiB and at one expert's bytes. CPU: there is no link; a miss is a read of the expert from
the checkpoint file into a RAM slot (the host tier is empty by default), so the "link" is a
`pread` of one expert's on-disk bytes from the largest shard (read once, then the median of
repeated reads: the page cache, where a run's re-read experts come from), and a RAM copy of
the same size is reported beside it.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _pread_GBps(path: Path, nbytes: int, repeats: int = 9) -> float:
    size = path.stat().st_size
    nbytes = max(1, min(nbytes, size))
    buf = bytearray(nbytes)
    times = []
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = (size - nbytes) // 2
        os.preadv(fd, [memoryview(buf)], offset)  # into the page cache: misses re-read hot data
        for _ in range(repeats):
            t0 = time.perf_counter()
            os.preadv(fd, [memoryview(buf)], offset)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return nbytes / max(statistics.median(times), 1e-9) / 1e9


def _ram_copy_GBps(nbytes: int, repeats: int = 9) -> float:
    src = torch.empty(max(nbytes, 1), dtype=torch.uint8).fill_(1)
    dst = torch.zeros_like(src)  # touched: page faults are not part of the copy
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / max(statistics.median(times), 1e-9) / 1e9


def measure_link(device: torch.device, expert_bytes: int, model_dir: Path) -> dict[str, Any]:
    """Bandwidths in GB/s; `bound_GBps` is the one the bound divides by (see module docstring)."""
    if device.type == "cuda":
        from moetier.bench.transfer import measure_raw

        with torch.cuda.device(device):
            at_16mb = measure_raw(16 << 20)
            at_expert = measure_raw(expert_bytes)
        return {
            "link": "pinned host->device (CUDA copy)",
            "GBps_16MiB": at_16mb,
            "GBps_expert": at_expert,
            "expert_bytes": expert_bytes,
            "bound_GBps": at_expert,
        }
    files = [model_dir] if model_dir.is_file() else model_dir.glob("*.safetensors")  # a .gguf
    shards = sorted(files, key=lambda p: p.stat().st_size)
    disk = _pread_GBps(shards[-1], expert_bytes) if shards else float("nan")
    return {
        "link": "cpu: pread from the checkpoint (page cache) into RAM; no device link",
        "GBps_16MiB": _pread_GBps(shards[-1], 16 << 20) if shards else float("nan"),
        "GBps_expert": disk,
        "ram_copy_GBps_expert": _ram_copy_GBps(expert_bytes),
        "expert_bytes": expert_bytes,
        "bound_GBps": disk,
    }
