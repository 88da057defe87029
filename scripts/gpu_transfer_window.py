"""Prefetch copies through the transfer engine on CUDA, by window (prefetch chunks on the copy
stream at once): link throughput with the main thread idle (in a wait that releases the GIL) and
busy (pure Python holding the GIL, as the host's cache decisions do), and how long an on-demand
copy issued in the middle of the stream takes; beside one whole copy of the same bytes.

    python3 scripts/gpu_transfer_window.py [--experts 128] [--expert-bytes 9437184]
        [--windows 1,2,4,8] [--out FILE.json]

Prints a markdown table; `--out` saves the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moetier.offload.transfer import ON_DEMAND, PREFETCH, CudaCopier, TransferEngine


def _busy_until(done) -> None:  # type: ignore[no-untyped-def]
    while not done():
        x = 0
        for k in range(2000):  # ~50 us of bytecode between checks
            x += k


def _idle_until(done) -> None:  # type: ignore[no-untyped-def]
    while not done():
        time.sleep(0.0002)


def run(window: int, busy: bool, host: torch.Tensor, slots: torch.Tensor, chunk: int) -> dict:
    dev = slots.device
    n = host.shape[0] - 1  # the last row is the on-demand copy's
    eng = TransferEngine(CudaCopier(dev), chunk, window=window, background=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    jobs = [eng.submit(i, slots[i], host[i], PREFETCH) for i in range(n)]
    wait = _busy_until if busy else _idle_until
    wait(lambda: eng.query(jobs[n // 2]))
    t_od = time.perf_counter()
    od = eng.submit("od", slots[n], host[n], ON_DEMAND)
    wait(lambda: eng.query(od))
    od_ms = (time.perf_counter() - t_od) * 1e3
    wait(lambda: all(eng.query(j) for j in jobs[-4:]))
    total = time.perf_counter() - t0
    assert torch.equal(slots[:8].cpu(), host[:8])
    nbytes = (n + 1) * host.shape[1]
    return {
        "window": window,
        "main_thread": "busy (Python)" if busy else "idle (sleep)",
        "gb_s": nbytes / total / 1e9,
        "on_demand_ms": od_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--expert-bytes", type=int, default=9437184)  # Qwen3-30B-A3B bf16 expert
    ap.add_argument("--chunk-bytes", type=int, default=8 << 20)
    ap.add_argument("--windows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    host = torch.randint(0, 255, (args.experts + 1, args.expert_bytes), dtype=torch.uint8)
    host = host.pin_memory()
    slots = torch.empty_like(host, device=dev)
    # one whole copy of the same bytes (the copy engine's rate)
    whole = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        slots.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        whole.append(host.numel() / (time.perf_counter() - t0) / 1e9)
    single = []
    for _ in range(10):  # one expert alone, on-demand, nothing else on the stream
        eng = TransferEngine(CudaCopier(dev), args.chunk_bytes, window=1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        job = eng.submit("one", slots[0], host[0], ON_DEMAND)
        while not eng.query(job):
            pass
        single.append((time.perf_counter() - t0) * 1e3)
    rows = []
    for w in [int(x) for x in args.windows.split(",")]:
        for busy in (False, True):
            rs = [run(w, busy, host, slots, args.chunk_bytes) for _ in range(args.repeats)]
            rows.append(
                {
                    "window": w,
                    "main_thread": rs[0]["main_thread"],
                    "gb_s": statistics.median(r["gb_s"] for r in rs),
                    "on_demand_ms": statistics.median(r["on_demand_ms"] for r in rs),
                    "repeats": [(r["gb_s"], r["on_demand_ms"]) for r in rs],
                }
            )
    print(
        f"device: {torch.cuda.get_device_name()}; {args.experts} prefetches of "
        f"{args.expert_bytes} B in chunks of {args.chunk_bytes} B, median of {args.repeats}"
    )
    print(
        f"whole copy: {statistics.median(whole):.1f} GB/s; one expert on demand alone: "
        f"{statistics.median(single):.3f} ms"
    )
    print("| window | main thread | prefetch GB/s | on-demand copy mid-stream (ms) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['window']} | {r['main_thread']} | {r['gb_s']:.1f} | {r['on_demand_ms']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "settings": vars(args),
                    "whole_copy_gb_s": whole,
                    "single_on_demand_ms": single,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
