"""The device cache's fill (kernels/_slot_fill_triton.py) reading page-locked host rows, on the
GPU: bandwidth per launch configuration for a decode-sized fill (4 of 128 experts missing, ids
on the device) and a prefill-sized one (64), beside two alternatives: a persistent variant
(a fixed grid of programs looping over the missing rows' chunks, several loads in flight per
program; an experiment kept here until a measurement says it belongs in the core) and the copy
engine (one cudaMemcpyAsync per expert). Rows are Qwen3-30B-A3B experts (9,437,184 bytes) in
LockedPages, as the host tier allocates them. Writes fill_sweep.json and fill_sweep.md to $OUT.

    python3 scripts/gpu_fill_sweep.py
    TRITON_INTERPRET=1 python3 scripts/gpu_fill_sweep.py --check   # both kernels, CPU, tiny
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from moetier.kernels._slot_fill_triton import fill_slots_triton

ROW_BYTES, EXPERTS, SLOTS, R = 9_437_184, 128, 96, 5


@triton.jit
def _fill_persistent(host_ptr, pool_ptr, src_ptr, dst_ptr, N, ROW, HOST_STRIDE, POOL_STRIDE,
                     BLOCK: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    chunks = tl.cdiv(ROW, BLOCK * UNROLL)
    for i in range(N):
        s = tl.load(src_ptr + i)
        if s >= 0:
            d = tl.load(dst_ptr + i)
            for c in range(p, chunks, programs):
                base = c * BLOCK * UNROLL
                for u in tl.static_range(UNROLL):  # UNROLL loads issued before their stores
                    offs = base + u * BLOCK + tl.arange(0, BLOCK)
                    m = offs < ROW
                    v = tl.load(host_ptr + s * HOST_STRIDE + offs, mask=m)
                    tl.store(pool_ptr + d * POOL_STRIDE + offs, v, mask=m)


def fill_persistent(host, pool, src, dst, programs: int, block: int, unroll: int, warps: int):
    _fill_persistent[(programs,)](host, pool, src, dst, src.numel(), pool.shape[1],
                                  host.stride(0), pool.stride(0), BLOCK=block, UNROLL=unroll,
                                  num_warps=warps)  # fmt: skip


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


def misses(n: int, experts: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pick [n] experts, src [E], dst [E]): one entry per expert, -1 where it is no miss, as
    DeviceCache.resolve passes them; miss j goes to slot j."""
    pick = torch.randperm(experts, generator=torch.Generator().manual_seed(n))[:n]
    src = torch.full((experts,), -1, dtype=torch.int64)
    dst = torch.full((experts,), -1, dtype=torch.int64)
    src[pick] = pick
    dst[pick] = torch.arange(n)
    return pick, src.to(device), dst.to(device)


def check() -> None:
    """Both kernels copy exactly the missing rows (run under TRITON_INTERPRET=1)."""
    host = torch.randint(-(2**62), 2**62, (16, 1000), dtype=torch.int64)
    pick, src, dst = misses(5, 16, "cpu")
    for fill in (
        lambda pool: fill_slots_triton(host, pool, src, dst, 64),
        lambda pool: fill_persistent(host, pool, src, dst, 3, 64, 2, 4),
    ):
        pool = torch.zeros(8, 1000, dtype=torch.int64)
        fill(pool)
        assert torch.equal(pool[:5], host[pick]) and not pool[5:].any()
    print("both kernels copy the missing rows")


def main() -> None:
    from moetier.offload.store import LockedPages

    words = ROW_BYTES // 8
    pages = LockedPages(EXPERTS * ROW_BYTES)
    host = pages.tensor(torch.int64).view(EXPERTS, words)
    host.copy_(torch.randint(-(2**62), 2**62, (EXPERTS, words), dtype=torch.int64))
    pool = torch.zeros(SLOTS, words, dtype=torch.int64, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict] = []

    def measure(n: int, pick: torch.Tensor, kernel: str, cfg: dict, fn) -> None:
        pool.zero_()
        ms = timed_ms(fn)
        ok = bool(torch.equal(pool[:n].cpu(), host[pick]))
        gbs = round(n * ROW_BYTES / 1e9 / ms * 1e3, 1)
        rows.append(dict(experts=n, kernel=kernel, config=cfg, ms=round(ms, 3), gb_s=gbs,
                         correct=ok))  # fmt: skip
        print(rows[-1], flush=True)

    for n in (4, 64):
        pick, src, dst = misses(n, EXPERTS, "cuda")
        for block in (1024, 4096, 16384):
            for warps in (4, 8):
                measure(n, pick, "chunked (core)", dict(block_words=block, num_warps=warps),
                        lambda: fill_slots_triton(host, pool, src, dst, block, warps))  # noqa: B023  # fmt: skip
        for per_sm in (1, 2, 4):
            for unroll in (1, 4):
                cfg = dict(programs=per_sm * sms, block_words=1024, unroll=unroll, num_warps=8)
                measure(n, pick, "persistent", cfg,
                        lambda: fill_persistent(host, pool, src, dst, cfg["programs"], 1024,  # noqa: B023
                                                cfg["unroll"], 8))  # noqa: B023  # fmt: skip

        def engine() -> None:
            for i, e in enumerate(pick.tolist()):  # noqa: B023
                pool[i].copy_(host[e], non_blocking=True)

        measure(n, pick, "copy engine", {}, engine)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fill_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), row_bytes=ROW_BYTES, rows=rows), f)
    lines = ["| experts | kernel | config | ms | GB/s | correct |", "|---" * 6 + "|"]
    for r in rows:
        cfg = ", ".join(f"{k} {v}" for k, v in r["config"].items()) or "–"
        lines.append(
            f"| {r['experts']} | {r['kernel']} | {cfg} | {r['ms']} | {r['gb_s']} | {r['correct']} |"
        )
    with open(os.path.join(out, "fill_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
