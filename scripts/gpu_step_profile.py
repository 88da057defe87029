"""Where one engine step's host and device time go (CUDA): a prompt step of each length in
PROMPTS and a decode step at batch BATCH, each profiled with torch.profiler (CPU and CUDA),
top operators by self CPU time and kernels by device time. Prints tables; no files.

    python3 scripts/gpu_step_profile.py MODEL_DIR [--prompts 64,2048] [--batch 64] \
        [--routing uniform] [--budget 100%] [--set "transfer_window=4 stream_eviction=true"] \
        [--decode-prompt 2048 --decode-steps 8]

--routing uniform replaces the random-weight routers' choice with the bench's seeded uniform
draws (on the device), as `bench latency --routing uniform` does (trace:PATH replays a routing
trace, as there); --batch 0 skips the decode
step; --decode-prompt sets the prompt length before it (64) and --decode-steps profiles that
many steps together (1). Each profiled step also gets its device timeline: host->device copies
and kernels as unions of intervals, their overlap, and how long the link sat idle between its
first and last copy (with experts offloaded, a prompt step is bound by the link: idle link time
is lost time).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moetier import LLM, SamplingParams


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            total += max(0.0, min(b, y[k][1]) - max(a, y[k][0]))
            k += 1
    return total


def timeline(prof: profile) -> str:
    """The device timeline of one profiled step: H2D copies vs kernels (ms)."""
    from torch.autograd import DeviceType

    dev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in dev]
    if not spans:
        return "timeline: no device events"
    h2d = _union([s for e, s in zip(dev, spans) if "HtoD" in e.name])
    kern = _union(
        [s for e, s in zip(dev, spans) if "Memcpy" not in e.name and "Memset" not in e.name]
    )
    first, last = min(a for a, _ in spans), max(b for _, b in spans)
    line = f"timeline: device span {(last - first) / 1e3:.1f} ms, kernels {_length(kern) / 1e3:.1f}"
    if h2d:
        link = h2d[-1][1] - h2d[0][0]
        line += (
            f", H2D busy {_length(h2d) / 1e3:.1f} ({len(h2d)} runs), link idle between its "
            f"first and last copy {(link - _length(h2d)) / 1e3:.1f}, copies under kernels "
            f"{_overlap(h2d, kern) / 1e3:.1f}, kernels after the last copy "
            f"{_length([(max(a, h2d[-1][1]), b) for a, b in kern if b > h2d[-1][1]]) / 1e3:.1f}"
        )
    return line


def _settings(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in text.split():
        key, _, value = item.partition("=")
        low = value.lower()
        out[key] = (
            True
            if low == "true"
            else False
            if low == "false"
            else (int(value) if value.lstrip("-").isdigit() else value)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", default="64,2048")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--routing", default="model", help="model, uniform or trace:PATH")
    ap.add_argument("--budget", default="100%")
    ap.add_argument("--set", default="", help='more LLM(...) settings: "key=value key=value"')
    ap.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens before decode")
    ap.add_argument("--decode-steps", type=int, default=1, help="decode steps profiled together")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        device="cuda",
        dtype="bfloat16",
        progress=False,
        expert_budget=args.budget,
        **_settings(args.set),  # type: ignore[arg-type]
    )
    eng = llm.engine
    if args.routing != "model":
        from moetier.bench.routing_override import install, make_source

        runner = eng.runner
        source = make_source(args.routing, runner.num_experts, runner.top_k, 0, "cuda")
        assert source is not None
        install(runner.model.moe_blocks(), source)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)

    seen = [0]

    def prompt_step(n: int) -> None:
        # a new prompt each time: a repeated one would reuse its cached prefix (prefix caching
        # is on), which is not the fresh prompt step being profiled
        seen[0] += 1
        eng.add_request([(7 * i + 3 + seen[0]) % 30000 + 1 for i in range(n)], params)
        eng.step()

    def drain() -> None:
        while eng.has_unfinished():
            eng.step()

    for n in [int(v) for v in args.prompts.split(",")]:
        for _ in range(2):  # warm: compiles, allocator
            prompt_step(n)
            drain()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prompt_step(n)
        torch.cuda.synchronize()
        print(f"\n## prompt {n}: step {1e3 * (time.perf_counter() - t0):.1f} ms")
        drain()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prompt_step(n)
            torch.cuda.synchronize()
        drain()
        print(timeline(prof))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    b = args.batch
    if b == 0:
        return
    n, k = args.decode_prompt, args.decode_steps
    params = SamplingParams(max_tokens=k + 3, temperature=1.0, seed=0, ignore_eos=True)
    for i in range(b):
        eng.add_request([(11 * i + j) % 30000 + 1 for j in range(n)], params)
    eng.step()  # the prompts
    eng.step()  # first decode step: captures its graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    print(
        f"\n## decode batch {b} after {n}-token prompts: step "
        f"{1e3 * (time.perf_counter() - t0):.1f} ms, "
        f"graph replays {eng.runner.graphs.replays if eng.runner.graphs else 0}"
    )
    before = eng.runner.stats.save_counts()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(k):
            eng.step()
        torch.cuda.synchronize()
    print(f"{k} decode steps profiled: {1e3 * (time.perf_counter() - t0) / k:.1f} ms a step")
    after = eng.runner.stats.save_counts()
    moved = {n: after[n] - before[n] for n in after if after[n] != before[n]}
    counts = ", ".join(f"{n}={v:.4g}" for n, v in moved.items())
    print(f"offload counters over those steps: {counts}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
