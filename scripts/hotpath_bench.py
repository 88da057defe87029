"""Hot-path A/B on the GPU machine: decode TPOT, GPU kernel time and launches per step for MoE
compute variants side by side in one process (synthetic real-shape checkpoint, random bf16
weights, random routing). Usage: python scripts/hotpath_bench.py OUT.json [layers] [shape]."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moetier import LLM, SamplingParams
from moetier.bench.synthetic import ensure_synthetic


def run(path: Path, budget: str | None, variant: dict, tokens: int = 32, host_budget=None) -> dict:
    llm = LLM(str(path), expert_budget=budget, host_budget=host_budget, device="cuda",
              dtype="bfloat16", progress=False, **variant)
    prompt = [(7 * i + 3) % 31000 + 1 for i in range(64)]
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng = llm.engine
    stats = eng.runner.stats

    def decode(n: int, profile: bool = False):
        req = eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=1.0, seed=0,
                                                     ignore_eos=True))
        eng.step()  # prefill
        torch.cuda.synchronize()
        stats.reset()
        times, toks = [], []
        prof = None
        if profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        steps = 0
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            steps += 1
        toks = list(req.output_token_ids)
        kern = launches = 0.0
        if prof is not None:
            prof.__exit__(None, None, None)
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kern = sum(e.device_time for e in evs) / 1e3 / steps  # ms per step
            launches = len(evs) / steps
        return times, toks, kern, launches

    times, toks, _, _ = decode(tokens)
    s = llm.offload_stats()
    _, _, kern, launches = decode(8, profile=True)
    out = {
        "budget": budget or "100%", **{k: v for k, v in variant.items()},
        "tpot_ms": statistics.median(times) * 1e3,
        "itl_p99_ms": sorted(times)[int(0.99 * (len(times) - 1))] * 1e3,
        "gpu_kernel_ms_per_step": kern, "kernels_per_step": launches,
        "exposed_fetch_ms_per_token": s["exposed_fetch_s"] * 1e3 / len(times),
        "h2d_MB_per_token": s["bytes_host_to_device"] / 1e6 / len(times),
        "device_hit_rate": s["device_hit_rate"], "tokens_head": toks[:8],
    }
    del llm, eng
    torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    shape = sys.argv[3] if len(sys.argv) > 3 else "qwen3-30b-a3b"
    t0 = time.perf_counter()
    path = ensure_synthetic(shape, layers, seed=0)  # GPU-filled, cached under MOETIER_HOME
    print(f"wrote checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
    variants = [
        # the previous default: grouped gather + bmm, eager norms and rotary
        {"moe_slot_kernel_max_pairs": 0, "fused_kernels": False, "cuda_graphs": False},
        {"moe_slot_kernel_max_pairs": 256, "fused_kernels": False, "cuda_graphs": False},
        {"moe_slot_kernel_max_pairs": 256, "fused_kernels": True, "cuda_graphs": False},
        {"moe_slot_kernel_max_pairs": 256, "fused_kernels": True, "cuda_graphs": True},
    ]
    rows = [run(path, None, v) for v in (variants[0], variants[3])]
    rows += [run(path, "25%", variants[3])]
    res = {"shape": shape, "layers": layers, "dtype": "bfloat16", "batch": 1, "prompt_len": 64,
           "decode": "sampled, temperature 1, seed 0, 48 tokens; random weights (random routing)",
           "torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
