"""`moetier bench latency`: per expert budget, TTFT/TPOT/ITL, offload counters and the bound.

Owns the measurement protocol of one run: load the model once per expert budget (100% always
first, as the reference), warm up, time every engine step of the timed pass with a device sync,
count the offload counters over decode steps only, profile a few decode steps separately for
device kernel time (CUDA), record the routing trace, and compute the bound from Belady's misses
on that trace. It does not format tables (report.py) or run the baselines (baselines.py).

"Per token" in every key means per decode step, i.e. one output token of each sequence (equal
to per output token at batch 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moetier.bench.belady import belady
from moetier.bench.measure import ConfigRun, run_budget
from moetier.bench.routing_override import make_source
from moetier.bench.trace_prefetch import check_sources, registered
from moetier.config import OffloadConfig
from moetier.errors import BudgetError
from moetier.weights.gguf import is_gguf

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass
class LatencySettings:
    """Everything that defines a latency run (all of it is written into the result)."""

    model: str | None = None
    synthetic: str | None = None
    layers: int | None = None
    synthetic_format: str = "bf16"  # the synthetic experts' storage (bench/synthetic.py)
    budgets: list[str] = field(default_factory=lambda: ["100%", "25%", "10%"])
    # a run after the reference with this device budget split between experts and KV (the
    # split decides the expert budget; its label is GPU_MEMORY_LABEL + the value)
    gpu_memory: str | None = None
    host_budget: str | None = None
    batch_size: int = 1
    input_len: int = 64
    output_len: int = 32
    num_prompts: int = 1
    seed: int = 0
    weights_seed: int | None = None  # synthetic weights; None = seed
    warmup: int = 1
    routing: str = "model"
    device: str = "auto"
    dtype: str = "auto"
    policy: str = "lru"
    compare: list[str] = field(default_factory=list)
    profile_steps: int = 8
    accelerate_output_len: int = 4
    save_trace: str | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


GPU_MEMORY_LABEL = "gpu-memory "


def normalize_budget(b: str) -> str:
    b = b.strip()
    return "100%" if b.lower() in ("100%", "all", "full", "none", "") else b


def resolve_model(s: LatencySettings) -> Path:
    from moetier.errors import ConfigError

    if s.synthetic:
        from moetier.bench.synthetic import ensure_synthetic

        ws = s.seed if s.weights_seed is None else s.weights_seed
        return ensure_synthetic(s.synthetic, s.layers, ws, fmt=s.synthetic_format)
    if not s.model:
        raise ConfigError("give --model PATH or --synthetic SHAPE")
    return Path(s.model)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_geometry(config: Any) -> dict[str, int]:
    """Experts per layer, top-k, hidden and expert intermediate size from an HF config."""
    e = (
        getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    if e is None:
        from moetier.errors import ConfigError

        raise ConfigError("the model config names no routed-expert count: is it an MoE model?")
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    # Gemma 4 names its top-k top_k_experts (the loader copies it; this reads the raw config)
    top_k = getattr(config, "num_experts_per_tok", None) or config.top_k_experts
    return dict(
        num_experts=int(e),
        top_k=int(top_k),
        hidden=int(config.hidden_size),
        intermediate=int(inter),
        num_layers=int(config.num_hidden_layers),
        vocab=int(config.vocab_size),
    )


def compute_dtype_bytes(dtype: str, device: torch.device, config: Any) -> int:
    if dtype != "auto":
        return _DTYPE_BYTES.get(dtype, 2)
    if device.type == "cpu":
        return 4
    return _DTYPE_BYTES.get(str(getattr(config, "dtype", None) or "bfloat16"), 2)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids in [1, vocab), from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, max(vocab, 2), (n, length), generator=gen).tolist()


def add_bounds(runs: list[ConfigRun], link: dict[str, Any]) -> None:
    """Fill offload_cost, Belady, the bound and the token check of every run (runs[0] = 100%)."""
    ref = runs[0].metrics
    bw = float(link["bound_GBps"]) * 1e9
    link_bytes = float(link.get("link_bytes_per_miss") or ref["expert_bytes"])
    for run in runs:
        m = run.metrics
        initial = (
            [
                (la, e)
                for la in run.trace.header.moe_layers
                for e in range(run.trace.header.num_experts)
            ]
            if run.num_slots >= run.total_experts
            else []
        )
        res = belady(run.trace.records, run.num_slots, run.decode_steps, initial)
        steps = max(len(run.decode_steps), 1)
        misses_per_step = res.misses / steps
        bound = ref["gpu_busy_ms"] + misses_per_step * link_bytes / bw * 1e3
        if run.placement is not None and "ranks" in m:  # the slowest rank's link
            misses_per_step = max(_rank_misses(run, m["ranks"], steps))
            bound = ref["gpu_busy_ms"] + misses_per_step * link_bytes / bw * 1e3
        # Prompt steps: at most num_slots of the keys they touch can be resident beforehand,
        # so the rest must cross the link at least once; the all-resident TTFT is the compute.
        keys = {
            (r.layer, e)
            for r in run.trace.records
            if r.step in run.prefill_steps
            for row in r.experts
            for e in row
        }
        must_move = max(0, len(keys) - run.num_slots) * link_bytes
        prefill_bound = max(must_move / bw * 1e3, ref["ttft_ms"])
        m.update(
            prefill_link_bytes_min=must_move,
            prefill_bound_ms=prefill_bound,
            ttft_over_bound=m["ttft_ms"] / prefill_bound if prefill_bound > 0 else float("nan"),
            offload_cost_ms=m["tpot_ms"] - ref["tpot_ms"],
            belady_hit_rate=res.hit_rate,
            belady_misses_per_token=misses_per_step,
            bound_tpot_ms=bound,
            tpot_over_bound=m["tpot_ms"] / bound if bound > 0 else float("nan"),
            tokens_match_reference=run.tokens == runs[0].tokens,
        )
        if "greedy_tokens" in ref and "greedy_tokens" in m:
            m["greedy_match_reference"] = m["greedy_tokens"] == ref["greedy_tokens"]


def _rank_misses(run: ConfigRun, ranks: list[dict[str, Any]], steps: int) -> list[float]:
    """Expert parallelism: each rank's Belady misses per decode step on its own experts with
    its own slots (each rank has its own link; a step waits for the slowest), set on each rank's
    row as `belady_misses_per_token`. Every rank's link is taken as the measured one."""
    out = []
    for row in ranks:
        r = row["rank"]
        owns = run.placement.owns
        records = [
            replace(rec, experts=[[e for e in x if owns(r, rec.layer, e)] for x in rec.experts])
            for rec in run.trace.records
        ]
        slots = int(row["device_slots"])
        initial = (
            [(la, e) for la in run.trace.header.moe_layers
             for e in range(run.trace.header.num_experts) if owns(r, la, e)]
            if slots >= row["owned_experts"]
            else []
        )  # fmt: skip
        res = belady(records, slots, run.decode_steps, initial)
        row["belady_hit_rate"] = res.hit_rate
        row["belady_misses_per_token"] = res.misses / steps
        out.append(res.misses / steps)
    return out


def run_latency(
    s: LatencySettings, on_partial: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """The whole run: every budget, the bound, optional baselines; returns the result dict.

    `on_partial` gets the result before the (slow) baselines run, so a run killed during them
    still leaves moetier's numbers behind.
    """
    from moetier.bench.bandwidth import measure_link
    from moetier.engine.model_runner import load_model_config

    path = resolve_model(s)
    config = load_model_config(Path(path))
    geo = model_geometry(config)
    device = resolve_device(s.device)
    numel = 3 * geo["hidden"] * geo["intermediate"]
    expert_bytes = numel * compute_dtype_bytes(s.dtype, device, config)
    # CPU: a miss reads the expert's on-disk bytes (checkpoint dtype) from the checkpoint.
    link_bytes = (
        expert_bytes
        if device.type == "cuda"
        else numel * _DTYPE_BYTES.get(str(getattr(config, "dtype", None) or "bfloat16"), 2)
    )
    if device.type != "cuda" and is_gguf(path):  # read as stored: the GGUF blocks' bytes
        from moetier.weights.gguf import open_gguf

        link_bytes = open_gguf(path)[2].packing(torch.float32).nbytes
    link = measure_link(device, link_bytes, path)
    link["link_bytes_per_miss"] = link_bytes
    budgets = ["100%"] + [b for b in map(normalize_budget, s.budgets) if b != "100%"]
    if s.gpu_memory:
        budgets.append(GPU_MEMORY_LABEL + s.gpu_memory)
    n = max(s.num_prompts, s.batch_size)
    prompts = make_prompts(n, s.input_len, geo["vocab"], s.seed)
    warm = make_prompts(s.batch_size, s.input_len, geo["vocab"], s.seed + 1_000_000)
    specs = [r.strip() for r in s.routing.split(",") if r.strip()] or ["model"]
    routings = [
        (sp, make_source(sp, geo["num_experts"], geo["top_k"], s.seed, device)) for sp in specs
    ]
    # --prefetch trace reads each call's recorded predictions off the trace routing: check the
    # routings before any model loads
    check_sources(s.llm_kwargs.get("prefetch"), [src for _, src in routings])
    notes: list[str] = []
    runs: list[ConfigRun] = []
    for b in budgets:
        try:
            with registered(s.llm_kwargs.get("prefetch")):
                runs += run_budget(path, b, s, routings, prompts, warm)
        except BudgetError as exc:  # too few slots for top-k: report it, keep the other budgets
            if b == "100%":
                raise
            notes.append(f"budget {b} skipped: {exc}")
            log.warning(notes[-1])
        except Exception as exc:  # e.g. out of memory: keep what the other budgets measured
            if b == "100%":
                raise
            log.exception("budget %s failed", b)
            notes.append(f"budget {b} failed: {type(exc).__name__}: {str(exc)[:300]}")
    groups = [[r for r in runs if r.metrics["routing"] == sp] for sp in specs]
    for spec, group in zip(specs, groups):
        add_bounds(group, link)
        bad = [r.metrics["budget"] for r in group if not r.metrics["tokens_match_reference"]]
        if bad:  # temperature-1 samples: an ulp of logit difference can flip one
            notes.append(f"routing {spec}: sampled token ids differ from 100% at {', '.join(bad)}")
            log.info(notes[-1])
    greedy_bad = [
        r.metrics["budget"] for r in groups[0] if r.metrics.get("greedy_match_reference") is False
    ]
    if greedy_bad:  # the model's own routers, temperature 0: a real disagreement
        notes.append(f"GREEDY token ids differ from 100% at {', '.join(greedy_bad)}")
        log.warning(notes[-1])
    if s.save_trace:
        from moetier.bench.trace import write_trace

        # The all-resident run is not recorded (see measure.py): save an offloaded run's trace.
        recorded = [r for r in groups[0] if r.trace.records] or groups[0]
        write_trace(s.save_trace, recorded[0].trace)
    settings = settings_record(s, path, device, geo, [src for _, src in routings])
    # the effective KV format (auto resolved to the model dtype), as the engines reported it
    settings["kv_cache_format"] = ",".join(sorted({r.metrics["kv_cache_dtype"] for r in runs}))
    result: dict[str, Any] = {
        "settings": settings,
        "link": link,
        "configs": [r.metrics for group in groups for r in group],
        "notes": notes,
    }
    if s.compare:
        from moetier.bench.baselines import run_baselines

        if on_partial is not None:
            on_partial(result)
        result["baselines"] = run_baselines(s, path, prompts[: s.batch_size], groups[0])
    return result


def _synthetic_meta(path: Path) -> dict[str, Any] | None:
    """The synthetic checkpoint's marker (shape, layers, seed, fill device), if it is one."""
    import json

    from moetier.bench.synthetic import MARKER

    base = Path(path)
    marker = (base.parent if base.is_file() else base) / MARKER  # a GGUF synthetic: the file
    return json.loads(marker.read_text()) if marker.exists() else None


def settings_record(
    s: LatencySettings, path: Path, device: torch.device, geo: dict[str, int], sources: list[Any]
) -> dict[str, Any]:
    """Every protocol setting, for the JSON and the table header."""
    rec = {k: v for k, v in asdict(s).items() if k not in ("progress",)}
    weights = f"random {s.synthetic_format} (synthetic)" if s.synthetic else "checkpoint"
    labels = []
    for source in sources:
        label = source.label if source is not None else "model routers"
        if s.synthetic and source is None:
            label += " (random weights: near-random, degenerate on deep stacks)"
        labels.append(label)
    routing = "; ".join(labels)
    rec.update(
        model_path=str(path),
        shape=s.synthetic or Path(path).name,
        weights=weights,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        device_type=device.type,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        routing_source=routing,
        prefetch=str(s.llm_kwargs.get("prefetch", "off")),
        kv_budget=str(s.llm_kwargs.get("num_kv_blocks", "default (engine's KV bytes)")),
        kv_cache_dtype=str(s.llm_kwargs.get("kv_cache_dtype", "auto")),
        stream_eviction=bool(s.llm_kwargs.get("stream_eviction", OffloadConfig.stream_eviction)),
        synthetic_meta=_synthetic_meta(path),
        sampling="temperature 1.0, per-request seed (seed + prompt index), ignore_eos",
        gpu_busy_source=(
            "torch.profiler CUDA kernel time, separate pass"
            if device.type == "cuda"
            else "cpu: step wall (compute runs on the host; host_overhead is 0 by definition)"
        ),
        per_token="per decode step (one output token per sequence)",
        **{f"model_{k}": v for k, v in geo.items()},
    )
    return rec
