"""Baselines run beside moetier in a latency run: transformers all resident, and accelerate.

Owns loading and timing the Hugging Face model (a manual decode loop with a KV cache, one
device sync per token) and the fit checks that decide whether a baseline can run; a baseline
that cannot run is reported as skipped with the reason, never silently dropped.

- transformers: every weight on the device; greedy decode with the model's own routers; its
  first tokens are compared with moetier's all-resident greedy tokens on the same prompt, also
  with the model's routers (taken before any routing override is installed), so the check holds
  whatever `--routing` the timed configurations use.
- accelerate: transformers with `device_map="auto"` and `max_memory` so that the device holds
  the non-expert weights plus the same routed-expert budget as moetier's first offloaded budget
  (plus 1 GiB for activations and KV); the rest is offloaded to CPU RAM and moved on every
  forward. Takes seconds per token, so it runs few output tokens. Needs CUDA.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_MARGIN = 1 << 30  # activations, KV and allocator slack on the device


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_hf_decode(model: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """Greedy decode with the model's KV cache; TTFT and per-token step times."""
    device = model.get_input_embeddings().weight.device
    if device.type == "meta":  # offloaded by accelerate: its hooks move inputs where needed
        device = torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
    ids = torch.tensor([prompt], device=device)
    _sync(dev)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    tokens = [int(nxt)]
    _sync(dev)
    ttft = time.perf_counter() - t0
    steps = []
    past = out.past_key_values
    for _ in range(new_tokens - 1):
        t1 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        _sync(dev)
        steps.append(time.perf_counter() - t1)
    return {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": statistics.median(steps) * 1e3 if steps else float("nan"),
        "tokens": tokens,
    }


def _free(model: Any) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_transformers(s: Any, path: Path, prompt: list[int], greedy: list[int]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from moetier.bench.latency import resolve_device

    device = resolve_device(s.device)
    need = checkpoint_bytes(path) * (2 if device.type == "cpu" else 1)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_ram()
    if need + _MARGIN > free:
        return {"skipped": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    dtype = torch.float32 if device.type == "cpu" else "auto"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=str(device))
    load_s = time.perf_counter() - t0
    res = time_hf_decode(model.eval(), prompt, s.output_len)
    _free(model)
    res["load_s"] = load_s
    if greedy:
        n = min(len(greedy), len(res["tokens"]))
        res["greedy_agree"] = res["tokens"][:n] == greedy[:n]
        res["detail"] = (
            f"all resident; first {n} greedy tokens "
            f"{'agree' if res['greedy_agree'] else 'DIFFER'} with moetier 100% (model routers)"
        )
    else:
        res["detail"] = "all resident, model routers; no moetier greedy tokens to check"
    return res


def run_accelerate(
    s: Any, path: Path, prompt: list[int], budget_bytes: int, routed_bytes: int, budget: str
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from moetier.bench.latency import resolve_device

    device = resolve_device(s.device)
    if device.type != "cuda":
        return {"skipped": "accelerate device_map offload needs a CUDA device"}
    nonexpert = max(checkpoint_bytes(path) - routed_bytes, 0)
    cap = nonexpert + budget_bytes + _MARGIN
    free = torch.cuda.mem_get_info(device)[0]
    if cap > free:
        return {"skipped": f"device budget {cap / 2**30:.1f} GiB above free {free / 2**30:.1f}"}
    index = device.index if device.index is not None else torch.cuda.current_device()
    max_memory = {index: cap, "cpu": max(_available_ram() - (4 << 30), 1 << 30)}
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype="auto", device_map="auto", max_memory=max_memory
    )
    load_s = time.perf_counter() - t0
    res = time_hf_decode(model.eval(), prompt, max(2, s.accelerate_output_len))
    _free(model)
    res.update(
        load_s=load_s,
        max_memory_device_bytes=cap,
        detail=f"device_map=auto, max_memory = non-expert + {budget} of routed + 1 GiB, "
        f"offload to cpu, {max(2, s.accelerate_output_len)} tokens",
    )
    return res


def run_baselines(
    s: Any, path: Path, prompts: list[list[int]], runs: list[Any]
) -> list[dict[str, Any]]:
    """One entry per requested baseline: its timings, or `skipped` with the reason."""
    out: list[dict[str, Any]] = []
    ref = runs[0].metrics
    for name in s.compare:
        entry: dict[str, Any] = {"name": name}
        try:
            if name == "transformers":
                entry.update(run_transformers(s, path, prompts[0], ref.get("greedy_tokens", [])))
            elif name == "accelerate":
                offloaded = [r.metrics for r in runs[1:]] or [ref]
                m = offloaded[0]
                routed = int(m["expert_bytes"] * m["total_experts"])
                entry.update(
                    run_accelerate(s, path, prompts[0], int(m["budget_bytes"]), routed, m["budget"])
                )
            else:
                entry["skipped"] = f"unknown baseline {name!r} (transformers, accelerate)"
        except Exception as exc:  # a baseline must not lose the moetier results
            log.exception("baseline %s failed", name)
            entry["skipped"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        out.append(entry)
    return out
