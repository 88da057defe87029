"""The device cache's fill kernel (kernels/_slot_fill_triton.py) reading page-locked host rows,
on the GPU: bandwidth per launch configuration (words per program x warps) for a decode-sized
fill (4 of 128 experts missing, ids on the device) and a prefill-sized one (64 experts), beside
the copy engine (one cudaMemcpyAsync per expert) on the same rows. Rows are Qwen3-30B-A3B
experts (9,437,184 bytes); the host rows are LockedPages, as the host tier allocates them.
Writes fill_sweep.json and fill_sweep.md to $OUT.

    python3 scripts/gpu_fill_sweep.py
"""

from __future__ import annotations

import json
import os

import torch

from moetier.kernels._slot_fill_triton import fill_slots_triton
from moetier.offload.store import LockedPages

ROW_BYTES, EXPERTS, SLOTS, R = 9_437_184, 128, 96, 5


def timed_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(R):
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[R // 2]


def main() -> None:
    words = ROW_BYTES // 8
    pages = LockedPages(EXPERTS * ROW_BYTES)
    host = pages.tensor(torch.int64).view(EXPERTS, words)
    host.copy_(torch.randint(-(2**62), 2**62, (EXPERTS, words), dtype=torch.int64))
    pool = torch.zeros(SLOTS, words, dtype=torch.int64, device="cuda")
    rows = []
    for n in (4, 64):
        g = torch.Generator().manual_seed(n)
        pick = torch.randperm(EXPERTS, generator=g)[:n]
        src = torch.full((EXPERTS,), -1, dtype=torch.int64)
        dst = torch.full((EXPERTS,), -1, dtype=torch.int64)
        src[pick] = pick  # one entry per expert, the misses' set, as DeviceCache.resolve passes
        dst[pick] = torch.arange(n)
        src, dst = src.cuda(), dst.cuda()
        gb = n * ROW_BYTES / 1e9
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                pool.zero_()
                ms = timed_ms(lambda: fill_slots_triton(host, pool, src, dst, block, warps))  # noqa: B023
                ok = bool(torch.equal(pool[dst[pick.cuda()]].cpu(), host[pick]))
                gbs = round(gb / ms * 1e3, 1)
                rows.append(dict(experts=n, kernel="triton", block_words=block, num_warps=warps,
                                 ms=round(ms, 3), gb_s=gbs, correct=ok))  # fmt: skip
                print(rows[-1], flush=True)

        def engine() -> None:
            for i, e in enumerate(pick.tolist()):  # noqa: B023
                pool[i].copy_(host[e], non_blocking=True)

        ms = timed_ms(engine)
        rows.append(dict(experts=n, kernel="copy engine", block_words=None, num_warps=None,
                         ms=round(ms, 3), gb_s=round(gb / ms * 1e3, 1), correct=True))  # fmt: skip
        print(rows[-1], flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fill_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), row_bytes=ROW_BYTES, rows=rows), f)
    lines = ["| experts | kernel | words/program | warps | ms | GB/s | correct |", "|---" * 7 + "|"]
    for r in rows:
        lines.append(
            f"| {r['experts']} | {r['kernel']} | {r['block_words'] or '–'} | "
            f"{r['num_warps'] or '–'} | {r['ms']} | {r['gb_s']} | {r['correct']} |"
        )
    with open(os.path.join(out, "fill_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
