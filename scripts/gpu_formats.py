# ruff: noqa: B023, E731, E741 - every lambda here runs before the loop moves on; I is the shape
"""The slot-reading expert kernels on compressed slots, on the GPU: per storage format of the
Qwen3-30B-A3B expert (D 2048, I 768, top-8), one decode-sized call (T = 1, 8 experts) and one
prefill-sized call (T = 512) timed in a CUDA graph of R calls, checked against the reference on
the decoded slots; bandwidth = the packed bytes the call's experts hold / time. Writes
formats.json and formats.md to $OUT. SWEEP=0 skips the launch-shape sweeps.

    PYTHONPATH=src OUT=$OUT python3 scripts/gpu_formats.py
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from moetier.kernels.expert_ffn import (
    expert_ffn,
    expert_ffn_reference,
)
from moetier.kernels.grouped_ffn import grouped_ffn
from moetier.kernels.slot_layout import slot_layout
from moetier.weights.formats import (
    ExpertFormat,
    ExpertPacking,
    ExpertShape,
    Fp8BlockCodec,
    get_codec,
)
from moetier.weights.gguf_quants import random_blocks
from moetier.weights.mxfp4 import random_encoded

D, I, K, S = 2048, 768, 8, 64
R = int(os.environ.get("R", "20"))
FORMATS = {
    "bf16": None,
    "fp8_e4m3": (Fp8BlockCodec(),) * 3,
    "gguf-q8_0": ("gguf-q8_0",) * 3,
    "gguf-q4_k_m": ("gguf-q4_k", "gguf-q4_k", "gguf-q6_k"),
    "gguf-q4_k": ("gguf-q4_k",) * 3,
    "gguf-q6_k": ("gguf-q6_k",) * 3,
    "mxfp4": ("mxfp4",) * 3,
}


def graph_time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(R):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / R)
    return sorted(times)[2]


def pool_of(
    name: str, gen: torch.Generator, d: int = D, i: int = I, n: int = S
) -> tuple[torch.Tensor, torch.Tensor, object, int]:
    """(pool on the GPU, the same experts dense, kernel layout, bytes per expert) for n
    experts of shape (d, i) (by default the Qwen3-30B-A3B expert, S of them)."""
    shape = ExpertShape(d, i)
    spec = FORMATS[name]
    if spec is None:
        dense = (torch.randn(n, 3 * i * d, generator=gen) / d**0.5).to(torch.bfloat16)
        return dense.cuda(), dense.cuda(), None, 3 * i * d * 2
    codecs = tuple(c if not isinstance(c, str) else get_codec(c) for c in spec)
    fmt = ExpertFormat(shape, torch.bfloat16, codecs)
    packing = ExpertPacking({0: fmt})
    pool = torch.zeros(n, packing.numel, dtype=torch.uint8)
    for s in range(n):
        for part, c, (rows, cols) in zip(fmt.parts(pool[s]), codecs, ((i, d), (i, d), (d, i))):
            if isinstance(c, Fp8BlockCodec):
                w = torch.randn(rows, cols, generator=gen) * 64
                scale = torch.full(c.scale_shape(rows, cols), 1 / (64 * cols**0.5))
                part.copy_(c.encode(w.clamp(-440, 440).to(torch.float8_e4m3fn), scale))
            elif c.name == "mxfp4":  # random nibbles, per-block scales around the RMS
                part.copy_(random_encoded(rows, cols, 2.0 / cols**0.5, gen))
            else:
                part.copy_(random_blocks(c, rows, cols, 2.0 / cols**0.5, gen).reshape(-1))
    layouts = slot_layout(packing)
    assert layouts is not None
    dense = torch.stack([torch.cat([t.flatten() for t in fmt.split(pool[s])]) for s in range(n)])
    return pool.cuda(), dense.cuda(), layouts[0], fmt.nbytes


def sweep(gen: torch.Generator) -> list[dict]:
    """Launch shapes per compressed format: the slot kernel at T = 1 (rows per tile x warps)
    and the grouped kernel at T = 512 (pairs per block, tile rows, warps)."""
    from moetier.kernels._expert_ffn_triton import FfnConfig, expert_ffn_triton
    from moetier.kernels._grouped_ffn_triton import GroupedConfig, grouped_ffn_triton

    rows = []
    for name in FORMATS:
        pool, dense, layout, nbytes = pool_of(name, gen)
        if layout is not None:
            layout = dataclasses.replace(layout, split=None)
        for t in [int(v) for v in os.environ.get("SWEEP_T", "1,512").split(",")]:
            x = torch.randn(t, D, generator=gen).cuda().to(torch.bfloat16)
            ids = torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(t)])
            ids = ids.sort(-1).values.cuda()
            slots = ids.to(torch.int32)
            w = torch.rand(t, K, generator=gen).cuda()
            touched = len(set(ids.flatten().tolist()))
            if t == 1:  # rows per tile, warps, pipeline stages (the loop's loads in flight)
                cfgs = [FfnConfig(bn, 256, wp, st, True, bn, 256, wp, st)
                        for bn, wp, st in ((4, 2, 1), (4, 2, 2), (4, 2, 3), (8, 2, 2),
                                           (8, 4, 3), (2, 1, 2), (4, 1, 2))]  # fmt: skip
                run_of = lambda c: lambda: expert_ffn_triton(x, pool, slots, w, I, c, layout)
            else:
                cfgs = [GroupedConfig(bm, bn, 64, wp, 3, bn, 64, wp, 3)
                        for bm in (32, 64) for bn in (64, 128) for wp in (4,)]  # fmt: skip
                run_of = lambda c: (
                    lambda: grouped_ffn_triton(
                        x, pool, slots, w, I, S, cfg=c, experts=ids, layout=layout
                    )
                )
            for c in cfgs:
                try:
                    us = graph_time_us(run_of(c))
                except Exception as e:  # a shape that does not compile: say so, go on
                    print(f"{name} T={t} {c}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(
                    dict(
                        format=name,
                        tokens=t,
                        config=dataclasses.asdict(c),
                        us=round(us, 1),
                        gb_s=round(touched * nbytes / us / 1e3, 1),
                    )
                )
                print("sweep", rows[-1], flush=True)
    return rows


def main() -> None:
    out = os.environ.get("OUT", "gpu-results")
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in FORMATS:
        pool, dense, layout, nbytes = pool_of(name, gen)
        if layout is not None:
            layout = dataclasses.replace(layout, split=None)  # kernels only
        for t in (1, 512):
            x = torch.randn(t, D, generator=gen).cuda().to(torch.bfloat16)
            ids = torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(t)])
            ids = ids.sort(-1).values.cuda()
            slots = ids.to(torch.int32)
            w = torch.rand(t, K, generator=gen).cuda()
            if t == 1:
                run = lambda: expert_ffn(x, pool, slots, w, I, layout)
                want = expert_ffn_reference(x, dense, slots, w, I)
            else:
                run = lambda: grouped_ffn(x, pool, slots, w, I, S, experts=ids, layout=layout)
                want = grouped_ffn(x, dense, slots, w, I, S, experts=ids)
            err = ((run().float() - want.float()).abs().max() / want.float().abs().max()).item()
            us = graph_time_us(run)
            touched = len(set(ids.flatten().tolist()))
            gbs = touched * nbytes / us / 1e3
            rows.append(
                dict(
                    format=name,
                    tokens=t,
                    experts=touched,
                    bytes_per_expert=nbytes,
                    us=round(us, 1),
                    gb_s=round(gbs, 1),
                    rel_err=err,
                )
            )
            print(rows[-1], flush=True)
    if os.environ.get("SWEEP", "1") == "1":
        rows += sweep(gen)
    with open(os.path.join(out, "formats.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [
        "| format | tokens | experts | MB/expert | us | GB/s read | rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "config" in r:
            continue
        mb = r["bytes_per_expert"] / 1e6
        lines.append(
            f"| {r['format']} | {r['tokens']} | {r['experts']} | {mb:.2f} | {r['us']} | "
            f"{r['gb_s']} | {r['rel_err']:.2e} |"
        )
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        if (
            "config" in r
            and (r["format"], r["tokens"]) not in best
            or ("config" in r and r["us"] < best[(r["format"], r["tokens"])]["us"])
        ):
            best[(r["format"], r["tokens"])] = r
    if best:
        lines += ["", "| format | tokens | best config | us | GB/s read |", "|---|---|---|---|---|"]
        for (fmt, t), r in sorted(best.items()):
            lines.append(f"| {fmt} | {t} | {r['config']} | {r['us']} | {r['gb_s']} |")
    with open(os.path.join(out, "formats.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
