"""The MoE exchange of expert parallelism, two ways, timed on this machine's backend (gloo on the
CPU, NCCL on CUDA with one GPU per rank).

- all-reduce (what moetier does): every rank's [T, K, D] terms, zero where another rank owns
  the expert, summed as int32 bits (exact: one writer an element);
- compact all-gather: each rank sends only its own pairs' terms, padded to the most any rank
  owns (every rank knows every rank's pairs: routing is replicated), then scatters them back
  into [T, K, D].

Routing: uniform top-K of E per token, round-robin placement. Prints a Markdown table (median
of `--iters` after warm-up) and checks that both give the same bits.

    python scripts/collective_bench.py --ranks 2 [--tokens 1,16,64,256,2048] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _routing(t: int, k: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).sort(-1).values


def _all_reduce(terms: torch.Tensor) -> torch.Tensor:
    buf = terms.clone()
    dist.all_reduce(buf.view(-1).view(torch.int32))
    return buf


def _all_gather(
    values: torch.Tensor, where: list[torch.Tensor], counts: list[int], rank: int, world: int
) -> torch.Tensor:
    t, k, d = values.shape
    m = max(counts)
    send = torch.zeros(m, d, dtype=values.dtype, device=values.device)
    send[: counts[rank]] = values.reshape(-1, d)[where[rank]]
    recv = torch.empty(world * m, d, dtype=values.dtype, device=values.device)
    dist.all_gather_into_tensor(recv, send)
    got = torch.empty(t * k, d, dtype=values.dtype, device=values.device)
    for r in range(world):
        got[where[r]] = recv[r * m : r * m + counts[r]]
    return got.view(t, k, d)


def _run(rank: int, world: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    d, k, e = args.hidden, args.top_k, args.experts
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        ids = _routing(t, k, e, seed=t)  # [T, K], the same on every rank
        owner = (ids % world).to(device)  # round-robin
        g = torch.Generator().manual_seed(100 + rank)
        values = torch.randn(t, k, d, generator=g).to(torch.bfloat16).to(device)
        mine = owner == rank
        terms = torch.where(mine[:, :, None], values, torch.zeros((), dtype=values.dtype,
                            device=device))  # fmt: skip
        counts = [int((owner == r).sum()) for r in range(world)]
        m = max(counts)
        where = [(owner == r).reshape(-1).nonzero().squeeze(1) for r in range(world)]

        all_reduce = partial(_all_reduce, terms)
        all_gather = partial(_all_gather, values, where, counts, rank, world)
        a, b = all_reduce(), all_gather()
        same = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        timings = {}
        for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather)):
            for _ in range(args.warmup):
                fn()
            samples = []
            for _ in range(args.iters):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            timings[name] = statistics.median(samples) * 1e6
        rows.append(
            (t, t * k * d * 2, m * d * 2, timings["all_reduce"], timings["all_gather"], same)
        )
    if rank == 0:
        out.put((str(device.type), dist.get_backend(), rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", default="1,16,64,256,2048")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, args.ranks, args.port, args, q)) for r in
             range(args.ranks)]  # fmt: skip
    for proc in procs:
        proc.start()
    device, backend, rows = q.get()
    for proc in procs:
        proc.join()
    lines = [
        f"MoE exchange, {args.ranks} ranks, {backend} on {device}, top-{args.top_k} of "
        f"{args.experts}, hidden {args.hidden}, bf16, round-robin placement, median of "
        f"{args.iters} (torch {torch.__version__}, {os.cpu_count()} CPUs)",
        "",
        "| tokens | [T,K,D] bytes | compact bytes a rank | all-reduce us | compact all-gather us "
        "| same bits |",
        "|---|---|---|---|---|---|",
    ]
    for t, full, compact, ar, ag, same in rows:
        lines.append(f"| {t} | {full:,} | {compact:,} | {ar:,.0f} | {ag:,.0f} | {same} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
