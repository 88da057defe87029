"""`moetier bench kv-formats`: what each KV cache storage format costs in bytes and in tokens.

Owns the comparison only: one LLM per `--kv-cache-dtype` format on the same checkpoint,
greedy generation of the same prompts (a fixed number of new tokens, EOS ignored), and per
format the stored KV bytes per token, the share of new tokens identical (position by position)
to the reference format's, and where each prompt first diverges. The prompts default to the
demo's trace prompts (demo/tracing.py) through the checkpoint's chat template.
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moetier.config import KV_CACHE_DTYPES
from moetier.errors import ConfigError


@dataclass
class KVFormatsSettings:
    model: str | None = None  # None: the demo model (built once, demo/builder.py)
    formats: list[str] = field(default_factory=lambda: ["auto", "bf16", "int8", "fp8"])
    reference: str = "auto"  # the format the others are compared against
    max_tokens: int = 128
    num_prompts: int | None = None  # None: every prompt
    device: str = "cpu"
    dtype: str = "auto"
    expert_budget: str | None = None  # None: every routed expert resident
    max_num_seqs: int | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


def first_divergence(ref: list[int], got: list[int]) -> int:
    """Index of the first new token that differs (len(ref) when none does)."""
    if len(ref) != len(got):
        raise ValueError(f"token lists differ in length: {len(ref)} vs {len(got)}")
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))


def compare_tokens(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Per-prompt greedy tokens against the reference's: identical share (position by
    position over all new tokens), first divergence per prompt, its mean and min, and how
    many prompts are identical throughout."""
    if len(ref) != len(got) or not ref:
        raise ValueError(f"expected the same non-zero prompt count, got {len(ref)}, {len(got)}")
    firsts = [first_divergence(r, g) for r, g in zip(ref, got)]
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    return {
        "identical_tokens": same,
        "total_tokens": total,
        "identical_share": same / total,
        "first_divergence": firsts,
        "first_divergence_mean": sum(firsts) / len(firsts),
        "first_divergence_min": min(firsts),
        "prompts_identical": sum(f == len(r) for f, r in zip(firsts, ref)),
    }


def demo_prompts(tokenizer: Any) -> list[list[int]]:
    """The demo's trace prompts (demo/tracing.py), each through the chat template."""
    from moetier.demo.calibration import chat_prompt_ids
    from moetier.demo.tracing import trace_prompts

    return [chat_prompt_ids(tokenizer, p) for p in trace_prompts()]


def run_kv_formats(
    settings: KVFormatsSettings,
    prompts: list[list[int]] | None = None,
    report: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate `prompts` (None: demo_prompts) with each format; the result JSON's dict.
    `report` gets one line per format as it finishes."""
    from moetier import LLM, SamplingParams

    s = settings
    for name in (*s.formats, s.reference):
        if name not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}"
            )
    if s.max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {s.max_tokens}")
    order = [s.reference] + [f for f in s.formats if f != s.reference]
    params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[list[int]]] = {}
    model_dir = s.model
    for name in order:
        llm = LLM(
            model_dir,
            device=s.device,
            dtype=s.dtype,
            expert_budget=s.expert_budget,
            max_num_seqs=s.max_num_seqs,
            progress=False,
            kv_cache_dtype=name,
            **s.llm_kwargs,
        )
        model_dir = llm.config.model  # the demo's directory once built
        if prompts is None:
            if llm.tokenizer is None:
                raise ConfigError(f"{model_dir} has no tokenizer: pass prompts as token ids")
            prompts = demo_prompts(llm.tokenizer)
        if s.num_prompts is not None:
            prompts = prompts[: s.num_prompts]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        stats = llm.offload_stats()
        runs[name] = {
            "kv_cache_dtype": name,
            "effective_format": stats["kv_cache_dtype"],
            "kv_bytes_per_token": stats["kv_bytes_per_token"],
            "kv_cache_bytes": stats["kv_cache_bytes"],
            "generate_s": round(wall, 3),
            "tokens": tokens[name],
        }
        del llm, outs
        gc.collect()
        if report is not None:
            report(f"kv-formats: {name} ({stats['kv_cache_dtype']}) generated in {wall:.1f} s")
    for name in order:
        runs[name].update(compare_tokens(tokens[s.reference], tokens[name]))
    assert prompts is not None
    settings_out = asdict(s)
    settings_out.update(
        model=model_dir,
        num_prompts=len(prompts),
        prompt_tokens=[len(p) for p in prompts],
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        machine=f"{platform.machine()} {platform.system()}",
    )
    return {"settings": settings_out, "formats": [runs[n] for n in order]}


def kv_formats_table(result: dict[str, Any]) -> str:
    """The per-format summary as a markdown table."""
    ref = result["settings"]["reference"]
    n = result["settings"]["max_tokens"]
    head = (
        f"| format | stored as | KV B/token | identical tokens vs {ref} | first divergence "
        f"mean / min (of {n}) | prompts identical | generate s |\n|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r['kv_cache_dtype']} | {r['effective_format']} | {r['kv_bytes_per_token']:,} | "
        f"{100 * r['identical_share']:.1f}% ({r['identical_tokens']}/{r['total_tokens']}) | "
        f"{r['first_divergence_mean']:.1f} / {r['first_divergence_min']} | "
        f"{r['prompts_identical']}/{len(r['first_divergence'])} | {r['generate_s']:.1f} |"
        for r in result["formats"]
    ]
    return "\n".join([head, *rows])
