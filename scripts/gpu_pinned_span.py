"""Does the size of the page-locked host tier, or its page size, change how fast experts cross
the link? On the GPU: host pools of each size in --sizes (GB), allocated as the host tier
allocates them (anonymous mmap, touched, cudaHostRegister: offload/store.py LockedPages), with
4 KiB pages and with transparent huge pages asked for (madvise MADV_HUGEPAGE before the first
touch); for each, the copy engine (one cudaMemcpyAsync per expert, as the transfer engine
issues them) and the device cache's Triton fill (kernels/_slot_fill_triton.py, zero-copy reads
of the mapped rows) move --experts random Qwen3-30B-A3B experts (9,437,184 bytes) from all over
the pool into device slots. Prints one line per measurement and writes pinned_span.json to $OUT.

    python3 scripts/gpu_pinned_span.py [--sizes 2,56] [--experts 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import re
import time
from pathlib import Path

import torch

ROW = 9_437_184


def _meminfo(key: str) -> str:
    text = Path("/proc/meminfo").read_text()
    m = re.search(rf"^{key}:\s+(\d+ kB)", text, re.M)
    return m.group(1) if m else "?"


def _pool(nbytes: int, huge: bool) -> tuple[mmap.mmap, torch.Tensor, float, float]:
    buf = mmap.mmap(-1, nbytes)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t0 = time.perf_counter()
    t.view(torch.int64).fill_(0x5A5A5A5A5A5A5A5A)
    touch = time.perf_counter() - t0
    t0 = time.perf_counter()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    assert not err, f"cudaHostRegister returned cudaError {err}"
    return buf, t, touch, time.perf_counter() - t0


def _timed(fn, repeats: int = 5) -> float:
    """Median ms of fn on the current stream."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _bandwidths(host: torch.Tensor, slots: torch.Tensor, pick: torch.Tensor) -> dict:
    """GB/s moving host rows `pick` into `slots`: copy engine, then the Triton fill."""
    from moetier.kernels._slot_fill_triton import fill_slots_triton

    n = pick.numel()
    src, dst = pick.cuda(), torch.arange(n, device="cuda")

    def engine() -> None:
        for j, r in enumerate(pick.tolist()):
            slots[j].copy_(host[r], non_blocking=True)

    out = {"copy_engine_GBps": round(n * ROW / 1e6 / _timed(engine), 1)}
    for block, warps in ((4096, 8), (16384, 8)):
        ms = _timed(lambda: fill_slots_triton(host, slots, src, dst, block, warps))  # noqa: B023
        out[f"triton_fill_b{block}_GBps"] = round(n * ROW / 1e6 / ms, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,56", help="host pool sizes, GB")
    ap.add_argument("--experts", type=int, default=128)
    args = ap.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    print(f"transparent_hugepage: {thp}", flush=True)
    n = args.experts
    slots = torch.empty(n, ROW // 8, dtype=torch.int64, device="cuda")
    rows: list[dict] = []
    for gb in (float(v) for v in args.sizes.split(",")):
        count = int(gb * 1e9) // ROW
        for huge in (False, True):
            before = _meminfo("AnonHugePages")
            buf, flat, touch_s, reg_s = _pool(count * ROW, huge)
            host = flat.view(torch.int64).view(count, ROW // 8)
            host[:, 0] = torch.arange(count)  # each row says which it is
            pick = torch.randperm(count, generator=torch.Generator().manual_seed(0))[:n]
            row = dict(pool_GB=round(count * ROW / 1e9, 1), huge_pages=huge,
                       anon_huge_before=before, anon_huge_after=_meminfo("AnonHugePages"),
                       touch_s=round(touch_s, 1), register_s=round(reg_s, 1))  # fmt: skip
            row.update(_bandwidths(host, slots, pick))
            assert torch.equal(slots[0].cpu(), host[pick[0]]), "the fill copied the wrong row"
            rows.append(row)
            print(row, flush=True)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
            del host, flat
            gc.collect()  # the last views of buf go: its pages are unmapped
            del buf
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "pinned_span.json"), "w") as f:
        json.dump(dict(transparent_hugepage=thp, expert_bytes=ROW, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
