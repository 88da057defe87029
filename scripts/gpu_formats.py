# ruff: noqa: B023, E731, E741 - every lambda here runs before the loop moves on; I is the shape
"""The slot-reading expert kernels on compressed slots, on the GPU: per storage format of the
Qwen3-30B-A3B expert (D 2048, I 768, top-8), one decode-sized call (T = 1, 8 experts) and one
prefill-sized call (T = 512) timed in a CUDA graph of R calls, checked against the reference on
the decoded slots; bandwidth = the packed bytes the call's experts hold / time. Writes
formats.json and formats.md to $OUT. SWEEP=0 skips the launch-shape sweeps.

MXFP4_COMPARE=1 instead times MXFP4's two slot-kernel decodes (kernels/_slot_tiles_triton.py:
`_dot_mxfp4`'s word loads, and the former byte-wise `_dot_mxfp4_bytes`, which
MXFP4_BYTE_TILES=1 selects at import, hence one process each: this one and a child) at
gpt-oss-20b's expert shape (D 2880, I 2880, 32 experts, top-4, its clamped SwiGLU and biases)
at T = 1 (4 pairs), T = 8 (32) and T = 32 (128 pairs: the large launch shape), and at the
Qwen3-30B-A3B shape above at T = 1, 8 and 16; each call checked against the reference, and the
two decodes' outputs compared bit for bit. With SWEEP=1 (the default) both also time a few
launch shapes at T = 1.

    PYTHONPATH=src OUT=$OUT python3 scripts/gpu_formats.py
    PYTHONPATH=src OUT=$OUT MXFP4_COMPARE=1 python3 scripts/gpu_formats.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch

from moetier.kernels import _slot_tiles_triton
from moetier.kernels.expert_ffn import (
    GPT_OSS_SWIGLU,
    PLAIN,
    ExpertMath,
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


# MXFP4_COMPARE: (name, D, I, experts = slots, K, the model's expert math (biases added below),
# token counts: decode at T = 1 and 8 on the small compressed launch shape, and 128 pairs on
# the large one)
GPT_OSS_MATH = ExpertMath(GPT_OSS_SWIGLU, 7.0, 1.702, topk_sum=True)
MXFP4_SHAPES = (
    ("gpt-oss-20b", 2880, 2880, 32, 4, GPT_OSS_MATH, (1, 8, 32)),
    ("qwen3-30b-a3b", D, I, S, K, PLAIN, (1, 8, 16)),
)


def mxfp4_decode() -> str:
    """Which MXFP4 decode this process's slot kernel runs (read at import)."""
    return "bytes" if _slot_tiles_triton.MXFP4_BYTE_TILES.value else "words"


def mxfp4_rows(keep: str) -> list[dict]:
    """This process's MXFP4 timings: per shape the slot kernel (expert_ffn, its production
    launch shape) at T = 1 and T = 8, each output saved under `keep` for the bit comparison,
    then (SWEEP=1) a few T = 1 launch shapes."""
    from moetier.kernels._expert_ffn_triton import FfnConfig, expert_ffn_triton

    decode = mxfp4_decode()
    gen = torch.Generator().manual_seed(0)  # the same pools, tokens and routes in each process
    rows: list[dict] = []
    for model, d, i, e, k, math, tokens in MXFP4_SHAPES:
        pool, dense, layout, nbytes = pool_of("mxfp4", gen, d, i, e)
        layout = dataclasses.replace(layout, split=None)
        if math.act == GPT_OSS_SWIGLU:  # gpt-oss's biases (model dtype), by expert id
            gb, ub, db = (
                (torch.randn(e, n, generator=gen) * 0.1).to(torch.bfloat16).cuda()
                for n in (i, i, d)
            )
            math = dataclasses.replace(math, biases=(gb, ub, db))
        for t in tokens:
            x = torch.randn(t, d, generator=gen).cuda().to(torch.bfloat16)
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
            ids = ids.sort(-1).values.cuda()
            slots = ids.to(torch.int32)
            w = torch.rand(t, k, generator=gen).cuda()
            touched = len(set(ids.flatten().tolist()))
            run = lambda: expert_ffn(x, pool, slots, w, i, layout, math, ids)
            got = run()
            want = expert_ffn_reference(x, dense, slots, w, i, None, math, ids)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            torch.save(got.cpu(), os.path.join(keep, f"{model}-T{t}-{decode}.pt"))
            us = graph_time_us(run)
            rows.append(
                dict(
                    decode=decode,
                    model=model,
                    tokens=t,
                    pairs=t * k,
                    experts=touched,
                    us=round(us, 1),
                    gb_s=round(touched * nbytes / us / 1e3, 1),
                    rel_err=err,
                )
            )
            print("mxfp4", rows[-1], flush=True)
            if t != 1 or os.environ.get("SWEEP", "1") != "1":
                continue
            for bn, bk, wp, st in ((4, 256, 1, 2), (4, 512, 1, 2), (4, 1024, 2, 2), (8, 512, 2, 2),
                                   (2, 512, 1, 2), (4, 128, 1, 2)):  # fmt: skip
                c = FfnConfig(bn, bk, wp, st, True, bn, bk, wp, st)
                fn = lambda: expert_ffn_triton(x, pool, slots, w, i, c, layout, math, ids)
                try:
                    us = graph_time_us(fn)
                except Exception as ex:  # a shape that does not compile: say so, go on
                    print(f"mxfp4 {model} {c}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                    continue
                rows.append(
                    dict(
                        decode=decode,
                        model=model,
                        tokens=t,
                        config=dataclasses.asdict(c),
                        us=round(us, 1),
                        gb_s=round(touched * nbytes / us / 1e3, 1),
                    )
                )
                print("mxfp4 sweep", rows[-1], flush=True)
    return rows


def mxfp4_compare(out: str) -> None:
    """Both decodes' rows (the other one from a child process with MXFP4_BYTE_TILES flipped),
    whether their outputs are equal bit for bit, to formats.json and formats.md."""
    with tempfile.TemporaryDirectory() as keep:
        rows = mxfp4_rows(keep)
        other = "0" if _slot_tiles_triton.MXFP4_BYTE_TILES.value else "1"
        env = dict(os.environ, MXFP4_BYTE_TILES=other, MXFP4_COMPARE_CHILD=keep)
        subprocess.run([sys.executable, __file__], env=env, check=True)
        with open(os.path.join(keep, "rows.json")) as f:
            rows += json.load(f)
        same = {}
        for model, *_, tokens in MXFP4_SHAPES:
            for t in tokens:
                a, b = (
                    torch.load(os.path.join(keep, f"{model}-T{t}-{v}.pt"))
                    for v in ("words", "bytes")
                )
                diff = (a.float() - b.float()).abs().max().item()
                same[(model, t)] = "yes" if torch.equal(a, b) else f"no (max diff {diff:.2e})"
    for r in rows:
        if "config" not in r:
            r["same_output"] = same[(r["model"], r["tokens"])]
    with open(os.path.join(out, "formats.json"), "w") as f:
        json.dump(rows, f, indent=1)
    by = {(r["model"], r["tokens"], r["decode"]): r for r in rows if "config" not in r}
    lines = [
        "| model shape | tokens | pairs | experts | bytes us | words us | speedup | words GB/s "
        "| rel err (words) | same output |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, *_, tokens in MXFP4_SHAPES:
        for t in tokens:
            old, new = by[(model, t, "bytes")], by[(model, t, "words")]
            lines.append(
                f"| {model} | {t} | {new['pairs']} | {new['experts']} | {old['us']} | "
                f"{new['us']} | {old['us'] / new['us']:.2f}x | {new['gb_s']} | "
                f"{new['rel_err']:.2e} | {new['same_output']} |"
            )
    swept = [r for r in rows if "config" in r]
    if swept:
        lines += ["", "| model shape | decode | config (bn, bk, warps, stages) | us | GB/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(swept, key=lambda r: (r["model"], r["decode"], r["us"])):
            c = r["config"]
            shape = (c["up_bn"], c["up_bk"], c["up_warps"], c["up_stages"])
            lines.append(f"| {r['model']} | {r['decode']} | {shape} | {r['us']} | {r['gb_s']} |")
    with open(os.path.join(out, "formats.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    child = os.environ.get("MXFP4_COMPARE_CHILD")
    if child:  # mxfp4_compare's other decode: its rows beside its saved outputs
        with open(os.path.join(child, "rows.json"), "w") as f:
            json.dump(mxfp4_rows(child), f)
        return
    out = os.environ.get("OUT", "gpu-results")
    os.makedirs(out, exist_ok=True)
    if os.environ.get("MXFP4_COMPARE") == "1":
        mxfp4_compare(out)
        return
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
