"""Synthetic checkpoints with real MoE shapes (random bf16 weights) and a decode benchmark.

Random weights give near-random routing: results measure the transfer path under uniform
expert demand, not real-text locality. Say so beside any number this produces.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=32000,
    ),
    "olmoe-1b-7b": dict(
        model_type="olmoe",
        hidden_size=2048,
        intermediate_size=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        vocab_size=32000,
    ),
}


def write_synthetic(path: Path, shape: str, num_layers: int, seed: int = 0) -> Path:
    """Write a `num_layers`-layer checkpoint of `shape`, one shard per layer, fused experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), num_hidden_layers=num_layers, **spec)
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.state_dict().items():
        shard = (
            f"layer-{name.split('.')[2]}.safetensors" if ".layers." in name else "rest.safetensors"
        )
        if "norm" in name:
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen) * (1.0 / max(p.shape[-1], 1) ** 0.5)
        groups.setdefault(shard, {})[name] = t.to(torch.bfloat16)
        weight_map[name] = shard
    for shard, tensors in groups.items():
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def decode_benchmark(
    path: Path,
    budget: str | None,
    prompt_len: int = 64,
    new_tokens: int = 64,
    device: str = "auto",
    dtype: str = "auto",
    moe_grouped_max_bytes: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """TTFT and TPOT at batch 1 for one expert budget, with offload counters per token."""
    from moetier import LLM, SamplingParams

    llm = LLM(
        str(path),
        expert_budget=budget,
        device=device,
        dtype=dtype,
        progress=False,
        moe_grouped_max_bytes=moe_grouped_max_bytes,
    )
    prompt = [(7 * i + 3) % 31000 + 1 for i in range(prompt_len)]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], warm)
    llm.engine.runner.stats.reset()
    engine = llm.engine
    # Sampled at temperature 1 so tokens (and routing) vary: greedy decoding of random weights
    # tends to repeat one token, which would make every step reuse the same experts.
    engine.add_request(
        prompt,
        SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed, ignore_eos=True),
    )
    times = []
    sync = torch.cuda.synchronize if llm.engine.runner.device.type == "cuda" else (lambda: None)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    s = llm.offload_stats()
    decode = times[1:]
    return {
        "budget": budget or "100%",
        "moe_compute": "loop" if moe_grouped_max_bytes == 0 else "default",
        "device_slots": s["device_slots"],
        "total_experts": s["total_experts"],
        "ttft_ms": times[0] * 1e3,
        "tpot_ms_median": statistics.median(decode) * 1e3,
        "tpot_ms_p99": sorted(decode)[int(0.99 * (len(decode) - 1))] * 1e3,
        "exposed_fetch_ms_per_token": s["exposed_fetch_s"] * 1e3 / len(times),
        "host_to_device_MB_per_token": s["bytes_host_to_device"] / 1e6 / len(times),
        "device_hit_rate": s["device_hit_rate"],
    }


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="decode benchmark on a synthetic real-shape MoE")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budgets", default="100%,50%,25%,10%")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seeds the weights and the sampling")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    ap.add_argument(
        "--compare-loop",
        action="store_true",
        help="also run each budget with the per-expert loop (grouped path off)",
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_synthetic(Path(tmp) / args.shape, args.shape, args.layers, args.seed)
        variants: list[int | None] = [0, None] if args.compare_loop else [None]
        rows = [
            decode_benchmark(
                path,
                None if b == "100%" else b,
                args.prompt_len,
                args.new_tokens,
                moe_grouped_max_bytes=v,
                seed=args.seed,
            )
            for b in args.budgets.split(",")
            for v in variants
        ]
    result = {
        "shape": args.shape,
        "layers": args.layers,
        "weights": "random bf16 (near-random routing)",
        "seed": args.seed,
        "decode": f"sampled, temperature 1.0, seed {args.seed}",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch": 1,
        "torch": torch.__version__,
        "write_s": time.perf_counter() - t0,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
