# ruff: noqa: B023 - every lambda here runs before the loop moves on
"""Launch-shape sweep of the slot-reading expert kernels (kernels/_expert_ffn_triton.py) on the
GPU: each half (gate/up, down) timed alone in a CUDA graph of R calls, per decode shape and batch,
every candidate checked against the reference. Writes JSON and a summary to $OUT.

    python3 scripts/gpu_ffn_sweep.py [--deadline S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

from moetier.kernels._expert_ffn_triton import LEGACY, FfnConfig, down, gate_up
from moetier.kernels.expert_ffn import expert_ffn_reference

SHAPES = {"deepseek-v2-lite": (6, 2048, 1408), "qwen3-30b-a3b": (8, 2048, 768)}
BATCHES = (1, 4, 16)
R = 20  # calls per graph


def graph_time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(R):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        a.record()
        for _ in range(4):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (4 * R))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deadline", type=float, default=240.0)
    args = ap.parse_args()
    t0 = time.monotonic()
    out_dir = os.environ.get("OUT", "gpu-results")
    os.makedirs(out_dir, exist_ok=True)
    up_space = [
        dict(up_bn=bn, up_bk=bk, up_warps=w, up_stages=st)
        for bn, bk, w, st in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8), (1, 3))
    ]
    down_space = [
        dict(split_down=False, down_bn=bn, down_bk=bk, down_warps=w, down_stages=st)
        for bn, bk, w, st in itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8), (1, 3))
    ] + [
        dict(split_down=True, down_bn=bn, down_bk=bk, down_warps=w, down_stages=st)
        for bn, bk, w, st in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8), (1, 3))
    ]
    results = []
    summary = []
    dev = "cuda"
    for name, (k, d, inter) in SHAPES.items():
        s = 64
        g = torch.Generator(device=dev).manual_seed(0)
        pool = (torch.randn(s, 3 * inter * d, generator=g, device=dev) / d**0.5).to(torch.bfloat16)
        for t in BATCHES:
            if time.monotonic() - t0 > args.deadline:
                summary.append(f"deadline: stopped before {name} T={t}")
                break
            x = torch.randn(t, d, generator=g, device=dev).to(torch.bfloat16)
            slots = torch.stack([torch.randperm(s, device=dev, generator=g)[:k] for _ in range(t)])
            slots = slots.sort(dim=-1).values.to(torch.int32).contiguous()
            w = torch.rand(t, k, generator=g, device=dev)
            want = expert_ffn_reference(x, pool, slots, w, inter).float()
            h = torch.empty(t * k, inter, dtype=x.dtype, device=dev)
            out = torch.empty_like(x)
            gate_up(x, pool, slots, h, k, inter, LEGACY)
            h_ref = h.clone()
            up_bytes = t * k * 2 * inter * d * 2
            down_bytes = t * k * inter * d * 2
            ups = []
            for c in up_space:
                cfg = FfnConfig(**c)
                try:
                    gate_up(x, pool, slots, h, k, inter, cfg)
                    ok = torch.allclose(h.float(), h_ref.float(), rtol=2**-6, atol=2**-6)
                    us = graph_time_us(lambda cfg=cfg: gate_up(x, pool, slots, h, k, inter, cfg))
                except Exception as exc:  # noqa: BLE001 - a config that fails to build is skipped
                    ok, us = False, float("nan")
                    print(f"{name} T={t} up {c}: {type(exc).__name__}: {exc}", file=sys.stderr)
                ups.append((us, ok, c))
                results.append(dict(shape=name, t=t, half="up", cfg=c, us=us, ok=ok))
            h.copy_(h_ref)
            downs = []
            for c in down_space:
                cfg = FfnConfig(**c)
                try:
                    down(h, pool, slots, w, out, inter, cfg)
                    err = ((out.float() - want).abs().max() / want.abs().max()).item()
                    ok = err < 2**-6
                    us = graph_time_us(lambda cfg=cfg: down(h, pool, slots, w, out, inter, cfg))
                except Exception as exc:  # noqa: BLE001
                    ok, us = False, float("nan")
                    print(f"{name} T={t} down {c}: {type(exc).__name__}: {exc}", file=sys.stderr)
                downs.append((us, ok, c))
                results.append(dict(shape=name, t=t, half="down", cfg=c, us=us, ok=ok))
            leg_up = graph_time_us(lambda: gate_up(x, pool, slots, h, k, inter, LEGACY))
            leg_down = graph_time_us(lambda: down(h, pool, slots, w, out, inter, LEGACY))
            best_up = min((u for u in ups if u[1] and u[0] == u[0]), key=lambda u: u[0])
            best_down = min((u for u in downs if u[1] and u[0] == u[0]), key=lambda u: u[0])
            bad = sum(1 for u in ups + downs if not u[1])
            summary.append(
                f"{name} T={t} K={k}: legacy up {leg_up:.1f} us ({up_bytes / leg_up / 1e6:.2f} "
                f"TB/s), down {leg_down:.1f} us ({down_bytes / leg_down / 1e6:.2f} TB/s); best up "
                f"{best_up[0]:.1f} us ({up_bytes / best_up[0] / 1e6:.2f} TB/s) {best_up[2]}; best "
                f"down {best_down[0]:.1f} us ({down_bytes / best_down[0] / 1e6:.2f} TB/s) "
                f"{best_down[2]}; {bad} candidates off the reference or failed"
            )
            for label, rows in (("up", ups), ("down", downs)):
                top = sorted((u for u in rows if u[1] and u[0] == u[0]), key=lambda u: u[0])[:5]
                for us, _, c in top:
                    summary.append(f"    {label} {us:7.1f} us {c}")
            print(summary[-11], flush=True)
    with open(os.path.join(out_dir, "ffn_sweep.json"), "w") as f:
        json.dump(results, f)
    with open(os.path.join(out_dir, "ffn_sweep.md"), "w") as f:
        f.write("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
