"""Where the host time of a decode step goes (GPU machine): cProfile and torch.profiler tables
for greedy batch-1 decode on a synthetic shape at 100% and 25%. Usage: OUT_DIR [layers]."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from moetier import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from hotpath_bench import write_fast  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    path = write_fast(Path("/tmp/synth") / f"qwen3-30b-a3b-{layers}", "qwen3-30b-a3b", layers)
    for budget in (None, "25%"):
        llm = LLM(str(path), expert_budget=budget, device="cuda", dtype="bfloat16", progress=False)
        eng = llm.engine
        prompt = [(7 * i + 3) % 31000 + 1 for i in range(64)]
        for temp in (0.0, 1.0):
            eng.add_request(prompt, SamplingParams(max_tokens=40, temperature=temp, seed=0,
                                                   ignore_eos=True))
            eng.step()
            for _ in range(5):
                eng.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                eng.step()
            torch.cuda.synchronize()
            pr.disable()
            wall = (time.perf_counter() - t0) / 20
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
            name = f"{budget or '100%'}-t{temp}".replace("%", "pct")
            (out / f"cprofile-{name}.txt").write_text(f"step wall (under cProfile) {wall*1e3:.2f} ms\n" + s.getvalue())
            # plain timing, and a torch.profiler CPU table
            t0 = time.perf_counter()
            for _ in range(5):
                eng.step()
            torch.cuda.synchronize()
            plain = (time.perf_counter() - t0) / 5
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    eng.step()
                torch.cuda.synchronize()
            tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            (out / f"torchprof-{name}.txt").write_text(f"plain step {plain*1e3:.2f} ms\n" + tab)
            print(name, f"plain step {plain*1e3:.2f} ms, cprofile step {wall*1e3:.2f} ms", flush=True)
            while eng.has_unfinished():
                eng.step()
        del llm, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
