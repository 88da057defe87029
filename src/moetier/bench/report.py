"""Bench results as text: the markdown table of a latency run and JSON saving.

Owns formatting only; the numbers come from latency.py and baselines.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moetier.config import format_bytes

_COLUMNS = (
    ("routing", "routing", "{}"),
    ("budget", "budget", "{}"),
    ("slots", "device_slots", "{}"),
    ("TTFT ms", "ttft_ms", "{:.1f}"),
    ("prefill H2D MB", "prefill_h2d_bytes", "mb"),
    ("prefill exposed ms", "prefill_exposed_fetch_ms", "{:.1f}"),
    ("prefill bound ms", "prefill_bound_ms", "{:.1f}"),
    ("TTFT/bound", "ttft_over_bound", "{:.2f}"),
    ("TPOT ms", "tpot_ms", "{:.2f}"),
    ("ITL p99", "itl_p99_ms", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("busy ms", "gpu_busy_ms", "{:.2f}"),
    ("launches", "kernel_launches_per_step", "{:.0f}"),
    ("host ovh ms", "host_overhead_ms", "{:.2f}"),
    ("offload cost ms", "offload_cost_ms", "{:.2f}"),
    ("exposed fetch ms", "exposed_fetch_ms_per_token", "{:.2f}"),
    ("miss host ms", "miss_host_ms_per_token", "{:.2f}"),
    ("sync wait ms", "routing_sync_ms_per_token", "{:.2f}"),
    ("H2D MB/tok", "h2d_bytes_per_token", "mb"),
    ("disk MB/tok", "disk_bytes_per_token", "mb"),
    ("hit", "device_hit_rate", "{:.3f}"),
    ("Belady hit", "belady_hit_rate", "{:.3f}"),
    ("bound ms", "bound_tpot_ms", "{:.2f}"),
    ("TPOT/bound", "tpot_over_bound", "{:.2f}"),
    ("same greedy", "greedy_match_reference", "{}"),
    ("same samples", "tokens_match_reference", "{}"),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if fmt == "mb":
        return f"{value / 1e6:.1f}"
    return fmt.format(value)


def settings_line(s: dict[str, Any]) -> str:
    return (
        f"model {s['shape']} ({s['weights']}, {s['model_num_layers']} layers), "
        f"{s['device_name']}, dtype {s['dtype']}, torch {s['torch']}"
        f"{_threads_note(s)}, policy {s['policy']}, "
        f"prefetch {s['prefetch']}, host budget {s['host_budget'] or 'default'}, "
        f"routing: {s['routing_source']}; batch {s['batch_size']}, input {s['input_len']}, "
        f"output {s['output_len']}, prompts {s['num_prompts']}, warmup {s['warmup']}, "
        f"seed {s['seed']}"
    )


_KV_COLUMN = ("KV", "kv_cache_dtype", "{}")  # beside "slots" when a run had --gpu-memory


def budget_label(cfg: dict[str, Any], gpu_memory: str | None) -> str:
    """The budget column: the expert budget as given, or for a --gpu-memory run the device
    budget (`gpu_memory`, as given) and the experts' share the split gave it:
    "gpu 20GiB (experts 41%)"; a share of the device also shows its bytes."""
    total = cfg.get("gpu_memory_bytes")
    if not total:  # None (older results) or 0: no split
        return str(cfg["budget"])
    given = gpu_memory or format_bytes(total)
    if given.endswith("%"):
        given += f" = {format_bytes(total)}"
    return f"gpu {given} (experts {100 * cfg['budget_fraction']:.0f}%)"


def latency_table(result: dict[str, Any]) -> str:
    s, link = result["settings"], result["link"]
    columns = list(_COLUMNS)
    if any(cfg.get("gpu_memory_bytes") for cfg in result["configs"]):
        columns.insert(columns.index(("slots", "device_slots", "{}")) + 1, _KV_COLUMN)
    lines = [
        settings_line(s),
        f"link: {link['link']}: {link['GBps_16MiB']:.2f} GB/s at 16 MiB, "
        f"{link['GBps_expert']:.2f} GB/s at one expert ({link['expert_bytes'] / 1e6:.2f} MB); "
        f"busy: {s['gpu_busy_source']}; per token = {s['per_token']}",
        "",
        "| " + " | ".join(c[0] for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for cfg in result["configs"]:
        row = {**cfg, "budget": budget_label(cfg, s.get("gpu_memory"))}
        lines.append("| " + " | ".join(_cell(row.get(k), f) for _, k, f in columns) + " |")
    for base in result.get("baselines", []):
        if base.get("skipped"):
            lines.append(f"\n{base['name']}: skipped: {base['skipped']}")
        else:
            lines.append(
                f"\n{base['name']}: TTFT {_cell(base.get('ttft_ms'), '{:.1f}')} ms, TPOT "
                f"{_cell(base.get('tpot_ms'), '{:.2f}')} ms ({base.get('detail', '')})"
            )
    for note in result.get("notes", []):
        lines.append(f"\nnote: {note}")
    lines.extend(_split_lines(result["configs"]))
    lines.extend(_prefetch_lines(result["configs"]))
    lines.extend(_top_kernels(result["configs"]))
    return "\n".join(lines)


def _split_lines(configs: list[dict[str, Any]]) -> list[str]:
    """Per configuration that ran under --gpu-memory: how the budget was split."""
    out = []
    for cfg in configs:
        if not cfg.get("gpu_memory_bytes"):  # None (older results) or 0: no split
            continue
        out.append(
            f"\nmemory split, {cfg.get('routing', '')} {cfg['budget']}: "
            f"{format_bytes(cfg['gpu_memory_bytes'])} -> experts "
            f"{format_bytes(cfg['split_expert_bytes'])} ({cfg['device_slots']} of "
            f"{cfg['total_experts']} experts, {100 * cfg['budget_fraction']:.1f}%), KV "
            f"{format_bytes(cfg['split_kv_bytes'])} ({cfg['kv_blocks']} blocks, "
            f"{cfg['kv_cache_dtype']}, {cfg['kv_bytes_per_token']} B/token); "
            f"rule: {cfg['split_reason']}"
        )
    return out


def _prefetch_lines(configs: list[dict[str, Any]]) -> list[str]:
    """Per configuration that prefetched: issued / used before eviction / in time / cancelled
    over the timed decode steps, and the bytes moved for prefetches never used (a prefetch
    issued before the timed steps may be used in them, so used can exceed issued)."""
    out: list[str] = []
    for cfg in configs:
        issued = cfg.get("prefetches_issued") or 0
        if not issued:
            continue
        out.append(
            f"\nprefetch, {cfg.get('routing', '')} {cfg.get('budget', '')}: issued {issued}, "
            f"used {cfg.get('prefetches_used', 0)}, "
            f"in time {cfg.get('prefetches_in_time', 0)}, cancelled "
            f"{cfg.get('prefetches_cancelled', 0)}, wasted "
            f"{(cfg.get('prefetch_wasted_bytes') or 0) / 1e6:.1f} MB"
        )
    return out


def _top_kernels(configs: list[dict[str, Any]], top: int = 8) -> list[str]:
    """Per configuration, the kernels that took the most device time per step."""
    out: list[str] = []
    for cfg in configs:
        kernels = cfg.get("top_kernels") or []
        if not kernels:
            continue
        busy = cfg.get("gpu_busy_ms") or 0.0
        out.append(f"\ntop kernels, {cfg.get('routing', '')} {cfg.get('budget', '')}:")
        for name, ms, calls in kernels[:top]:
            share = f"{100 * ms / busy:.0f}%" if busy else "-"
            out.append(f"  {ms:7.3f} ms/step ({share:>4}) {calls:6.1f} launches  {name[:90]}")
    return out


def _clean(obj: Any) -> Any:
    """JSON has no NaN: write it as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def save_json(path: str | Path, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_clean(result), indent=1) + "\n")


def _threads_note(s: dict[str, Any]) -> str:
    """' (N threads)' when the run recorded torch's CPU threads (older results did not)."""
    n = s.get("torch_threads")
    return f", threads {n}" if n else ""
