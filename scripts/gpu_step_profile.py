"""Where one engine step's host and device time go (CUDA): a prompt step of each length in
PROMPTS and a decode step at batch BATCH, each profiled with torch.profiler (CPU and CUDA),
top operators by self CPU time and kernels by device time. Prints tables; no files.

    python3 scripts/gpu_step_profile.py MODEL_DIR [--prompts 64,2048] [--batch 64] \
        [--routing uniform] [--budget 100%]

--routing uniform replaces the random-weight routers' choice with the bench's seeded uniform
draws (on the device), as `bench latency --routing uniform` does; --batch 0 skips the decode
step.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moetier import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", default="64,2048")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--routing", default="model", choices=["model", "uniform"])
    ap.add_argument("--budget", default="100%")
    args = ap.parse_args()
    llm = LLM(
        args.model, device="cuda", dtype="bfloat16", progress=False, expert_budget=args.budget
    )
    eng = llm.engine
    if args.routing == "uniform":
        from moetier.bench.routing_override import UniformRouting, install

        runner = eng.runner
        source = UniformRouting(runner.num_experts, runner.top_k, 0, "cuda")
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
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    b = args.batch
    if b == 0:
        return
    for i in range(b):
        eng.add_request([(11 * i + j) % 30000 + 1 for j in range(64)], params)
    eng.step()  # the prompts
    eng.step()  # first decode step: captures its graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    print(f"\n## decode batch {b}: step {1e3 * (time.perf_counter() - t0):.1f} ms, "
          f"graph replays {eng.runner.graphs.replays if eng.runner.graphs else 0}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
