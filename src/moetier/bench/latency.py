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

import contextlib
import gc
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.bench.belady import belady
from moetier.bench.routing_override import RoutingSource, install, make_source
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecorder

log = logging.getLogger(__name__)

_COUNTERS = (
    "requests",
    "device_hits",
    "host_hits",
    "disk_reads",
    "evictions",
    "bytes_host_to_device",
    "bytes_disk_to_host",
    "exposed_fetch_s",
)
GREEDY_CHECK_TOKENS = 8
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass
class LatencySettings:
    """Everything that defines a latency run (all of it is written into the result)."""

    model: str | None = None
    synthetic: str | None = None
    layers: int | None = None
    budgets: list[str] = field(default_factory=lambda: ["100%", "25%", "10%"])
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


@dataclass
class ConfigRun:
    """One expert budget's measurements, before the cross-config figures are added."""

    metrics: dict[str, Any]
    tokens: list[list[int]]
    trace: RoutingTrace
    decode_steps: set[int]
    num_slots: int
    total_experts: int


def normalize_budget(b: str) -> str:
    b = b.strip()
    return "100%" if b.lower() in ("100%", "all", "full", "none", "") else b


def resolve_model(s: LatencySettings) -> Path:
    from moetier.errors import ConfigError

    if s.synthetic:
        from moetier.bench.synthetic import ensure_synthetic

        ws = s.seed if s.weights_seed is None else s.weights_seed
        return ensure_synthetic(s.synthetic, s.layers, ws)
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
    return dict(
        num_experts=int(e),
        top_k=int(config.num_experts_per_tok),
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):  # resets VmHWM (Linux); elsewhere the peak is global
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class _Iteration:
    step_s: list[float]
    decode: list[bool]
    ttft_s: float
    wall_s: float
    tokens: list[list[int]]


class _Driver:
    """Steps an engine over a batch of requests, timing each step and tagging the trace."""

    def __init__(self, llm: Any, recorder: TraceRecorder, bar: Any) -> None:
        self.llm, self.engine = llm, llm.engine
        self.device: torch.device = llm.engine.runner.device
        self.recorder, self.bar = recorder, bar
        self.step = 0
        self.counters = dict.fromkeys(_COUNTERS, 0.0)  # decode steps of the timed pass
        self.decode_steps: set[int] = set()
        self._scheduled: list[Any] = []
        scheduler = self.engine.scheduler
        original = scheduler.schedule

        def schedule() -> Any:  # records which request each token of the step belongs to
            out = original()
            self._scheduled = list(out.scheduled)
            recorder.token_requests = [
                s.request.request_id for s in out.scheduled for _ in range(s.num_new_tokens)
            ]
            return out

        scheduler.schedule = schedule

    def _stats(self) -> dict[str, float]:
        d = self.llm.offload_stats()
        return {k: float(d[k]) for k in _COUNTERS}

    def run(self, prompts: list[list[int]], max_tokens: int, seed: int, timed: bool) -> _Iteration:
        from moetier import SamplingParams

        reqs = [
            self.engine.add_request(
                p,
                SamplingParams(
                    max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True
                ),
            )
            for i, p in enumerate(prompts)
        ]
        step_s: list[float] = []
        decode: list[bool] = []
        ttft = -1.0
        _sync(self.device)
        start = time.perf_counter()
        while self.engine.has_unfinished():
            before = self._stats() if timed else None
            self.recorder.step = self.step
            t0 = time.perf_counter()
            self.engine.step()
            _sync(self.device)
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            is_decode = bool(self._scheduled) and all(
                s.request.num_computed_tokens - s.num_new_tokens >= len(s.request.prompt_token_ids)
                for s in self._scheduled
            )
            decode.append(is_decode)
            if ttft < 0 and all(r.output_token_ids for r in reqs):
                ttft = t1 - start
            if timed and is_decode and before is not None:
                after = self._stats()
                for k in _COUNTERS:
                    self.counters[k] += after[k] - before[k]
                self.decode_steps.add(self.step)
            self.step += 1
            self.bar.update(1)
        wall = time.perf_counter() - start
        return _Iteration(step_s, decode, ttft, wall, [list(r.output_token_ids) for r in reqs])

    def profile(self, prompts: list[list[int]], steps: int, seed: int) -> Any:
        """Kernel time of `steps` decode steps of a fresh batch (CUDA only; not recorded)."""
        from moetier import SamplingParams
        from moetier.bench.profiling import profile_steps

        for i, p in enumerate(prompts):
            params = SamplingParams(
                max_tokens=steps + 2, temperature=1.0, seed=seed + i, ignore_eos=True
            )
            self.engine.add_request(p, params)
        self.engine.step()  # prefill, not profiled
        self.engine.step()
        result = profile_steps(lambda: self.engine.step(), steps)
        while self.engine.has_unfinished():
            self.engine.step()
        return result


def run_config(
    path: Path,
    budget: str,
    s: LatencySettings,
    source: RoutingSource | None,
    prompts: list[list[int]],
    warm_prompts: list[list[int]],
) -> ConfigRun:
    """Measure one expert budget (see module docstring for the protocol)."""
    from tqdm.auto import tqdm

    from moetier import LLM

    device = resolve_device(s.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()
    t_load = time.perf_counter()
    llm = LLM(
        str(path),
        expert_budget=None if budget == "100%" else budget,
        host_budget=s.host_budget,
        device=s.device,
        dtype=s.dtype,
        seed=s.seed,
        policy=s.policy,
        progress=False,
        **s.llm_kwargs,
    )
    load_s = time.perf_counter() - t_load
    blocks = llm.engine.runner.model.moe_blocks()
    undo = install(blocks, source) if source is not None else None
    if source is not None:
        source.reset()
    plan = llm.offload_stats()
    num_layers = int(llm.engine.runner.hf_config.num_hidden_layers)
    header = TraceHeader(
        num_layers,
        int(llm.engine.runner.num_experts),
        int(llm.engine.runner.top_k),
        [int(b.layer) for b in blocks],
        int(plan["expert_bytes"]),
    )
    recorder = TraceRecorder(header)
    recorder.attach(blocks)
    b = s.batch_size
    iters = max(1, math.ceil(s.num_prompts / b))
    warm_tokens = min(8, s.output_len)
    total = s.warmup * warm_tokens + iters * s.output_len
    bar = tqdm(
        total=total, desc=f"budget {budget}", unit="step", disable=not s.progress, file=sys.stderr
    )
    driver = _Driver(llm, recorder, bar)
    try:
        for w in range(s.warmup):
            driver.run(warm_prompts[:b], warm_tokens, s.seed + 10_000 + w * b, timed=False)
        llm.engine.runner.stats.reset()
        reset_peak_rss()
        its = [
            driver.run(prompts[i * b : (i + 1) * b], s.output_len, s.seed + i * b, timed=True)
            for i in range(iters)
        ]
        recorder.detach()
        greedy = _greedy_tokens(llm, prompts[0], s) if budget == "100%" else []
        device_time = None
        if device.type == "cuda" and s.profile_steps > 0:
            device_time = driver.profile(warm_prompts[:b], s.profile_steps, s.seed + 20_000)
        peak_dev = (
            int(torch.cuda.max_memory_allocated(device))
            if device.type == "cuda"
            else _resident_bytes(llm)
        )
        peak_rss = peak_rss_bytes()
    finally:
        bar.close()
        recorder.detach()
        if undo is not None:
            undo()
    metrics = _metrics(its, driver, device_time, plan, budget, load_s)
    metrics.update(peak_device_bytes=peak_dev, peak_host_rss_bytes=peak_rss)
    if greedy:
        metrics["greedy_tokens"] = greedy
    run = ConfigRun(
        metrics,
        [t for it in its for t in it.tokens],
        recorder.trace,
        driver.decode_steps,
        int(plan["device_slots"]),
        int(plan["total_experts"]),
    )
    del driver, llm, blocks
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def _greedy_tokens(llm: Any, prompt: list[int], s: LatencySettings) -> list[int]:
    """Greedy tokens of the first prompt, for the transformers agreement check (else [])."""
    from moetier import SamplingParams

    if "transformers" not in s.compare or s.routing != "model":
        return []
    params = SamplingParams(max_tokens=GREEDY_CHECK_TOKENS, temperature=0.0, ignore_eos=True)
    return list(llm.generate([prompt], params)[0].outputs[0].token_ids)


def _resident_bytes(llm: Any) -> int:
    """CPU stand-in for peak device bytes: model parameters and buffers plus the slot pool."""
    model = llm.engine.runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    params = sum(t.numel() * t.element_size() for t in tensors)
    cache = llm.engine.runner.expert_cache
    return int(params + cache.num_slots * llm.offload_stats()["expert_bytes"])


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _metrics(
    its: list[_Iteration],
    driver: _Driver,
    device_time: Any,
    plan: dict[str, float],
    budget: str,
    load_s: float,
) -> dict[str, Any]:
    itl = [t for it in its for t, d in zip(it.step_s, it.decode) if d]
    n = max(len(itl), 1)
    tpot = statistics.median(itl) * 1e3 if itl else float("nan")
    tokens = sum(len(t) for it in its for t in it.tokens)
    wall = sum(it.wall_s for it in its)
    c = driver.counters
    if device_time is not None:
        gpu_busy, launches = device_time.kernel_ms_per_step, device_time.launches_per_step
        copy_ms = device_time.copy_ms_per_step
    else:  # CPU: the compute device is the host, so a step is all "busy"
        gpu_busy, launches, copy_ms = tpot, 0.0, 0.0
    lookups = max(c["requests"], 1.0)
    return dict(
        budget=budget,
        device_slots=int(plan["device_slots"]),
        total_experts=int(plan["total_experts"]),
        budget_fraction=plan["device_slots"] / max(plan["total_experts"], 1),
        budget_bytes=int(plan["device_slots"] * plan["expert_bytes"]),
        host_rows=int(plan["host_rows"]),
        expert_bytes=int(plan["expert_bytes"]),
        load_s=load_s,
        ttft_ms=statistics.median(it.ttft_s for it in its) * 1e3,
        tpot_ms=tpot,
        itl_p50_ms=_pct(itl, 0.5) * 1e3,
        itl_p99_ms=_pct(itl, 0.99) * 1e3,
        e2e_latency_ms=statistics.median(it.wall_s for it in its) * 1e3,
        tokens_per_s=tokens / wall if wall > 0 else float("nan"),
        decode_steps=len(itl),
        gpu_busy_ms=gpu_busy,
        kernel_launches_per_step=launches,
        device_copy_ms_per_step=copy_ms,
        host_overhead_ms=tpot - gpu_busy,
        exposed_fetch_ms_per_token=c["exposed_fetch_s"] * 1e3 / n,
        h2d_bytes_per_token=c["bytes_host_to_device"] / n,
        disk_bytes_per_token=c["bytes_disk_to_host"] / n,
        lookups_per_token=c["requests"] / n,
        misses_per_token=(c["requests"] - c["device_hits"]) / n,
        device_hit_rate=c["device_hits"] / lookups,
        host_hit_rate=c["host_hits"] / lookups,
        disk_read_rate=c["disk_reads"] / lookups,
    )


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
        m.update(
            offload_cost_ms=m["tpot_ms"] - ref["tpot_ms"],
            belady_hit_rate=res.hit_rate,
            belady_misses_per_token=misses_per_step,
            bound_tpot_ms=bound,
            tpot_over_bound=m["tpot_ms"] / bound if bound > 0 else float("nan"),
            tokens_match_reference=run.tokens == runs[0].tokens,
        )


def run_latency(s: LatencySettings) -> dict[str, Any]:
    """The whole run: every budget, the bound, optional baselines; returns the result dict."""
    from transformers import AutoConfig

    from moetier.bench.bandwidth import measure_link

    path = resolve_model(s)
    config = AutoConfig.from_pretrained(str(path))
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
    link = measure_link(device, link_bytes, path)
    link["link_bytes_per_miss"] = link_bytes
    budgets = ["100%"] + [b for b in map(normalize_budget, s.budgets) if b != "100%"]
    n = max(s.num_prompts, s.batch_size)
    prompts = make_prompts(n, s.input_len, geo["vocab"], s.seed)
    warm = make_prompts(s.batch_size, s.input_len, geo["vocab"], s.seed + 1_000_000)
    source = make_source(s.routing, geo["num_experts"], geo["top_k"], s.seed)
    runs = [run_config(path, b, s, source, prompts, warm) for b in budgets]
    add_bounds(runs, link)
    if s.save_trace:
        from moetier.bench.trace import write_trace

        write_trace(s.save_trace, runs[0].trace)
    notes = []
    if not all(r.metrics["tokens_match_reference"] for r in runs):
        bad = [r.metrics["budget"] for r in runs if not r.metrics["tokens_match_reference"]]
        notes.append(f"token ids differ from the 100% reference at budgets {', '.join(bad)}")
        log.warning(notes[-1])
    result: dict[str, Any] = {
        "settings": settings_record(s, path, device, geo, source),
        "link": link,
        "configs": [r.metrics for r in runs],
        "notes": notes,
    }
    if s.compare:
        from moetier.bench.baselines import run_baselines

        result["baselines"] = run_baselines(s, path, prompts[: s.batch_size], runs, source)
    return result


def settings_record(
    s: LatencySettings, path: Path, device: torch.device, geo: dict[str, int], source: Any
) -> dict[str, Any]:
    """Every protocol setting, for the JSON and the table header."""
    rec = {k: v for k, v in asdict(s).items() if k not in ("progress",)}
    weights = "random bf16 (synthetic)" if s.synthetic else "checkpoint"
    routing = source.label if source is not None else "model routers"
    if s.synthetic and source is None:
        routing += " (random weights: near-random, degenerate on deep stacks)"
    rec.update(
        model_path=str(path),
        shape=s.synthetic or Path(path).name,
        weights=weights,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        device_type=device.type,
        torch=torch.__version__,
        routing_source=routing,
        prefetch=str(s.llm_kwargs.get("prefetch", "off")),
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
