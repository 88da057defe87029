"""One measured configuration (expert budget x routing): step timings, counters, device time.

Owns the step driver (one device sync per engine step, the trace's step and request tags,
decode-only counter deltas), the profiled pass (CUDA kernel time, separate from the timed pass)
and the per-configuration metrics. The run as a whole (budgets, bound, baselines) is latency.py.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetier.bench.routing_override import RoutingSource, install
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecorder

if TYPE_CHECKING:
    from moetier.bench.latency import LatencySettings

_COUNTERS = (
    "requests",
    "device_hits",
    "host_hits",
    "disk_reads",
    "evictions",
    "bytes_host_to_device",
    "bytes_disk_to_host",
    "exposed_fetch_s",
    "resident_lookups",
    "miss_host_s",
    "routing_sync_s",
    "prefetches_issued",
    "prefetches_used",
    "prefetches_in_time",
    "prefetches_cancelled",
    "prefetch_wasted_bytes",
    "decode_graph_replays",
    "prefill_graph_replays",
)
GREEDY_CHECK_TOKENS = 8


@dataclass
class ConfigRun:
    """One expert budget's measurements, before the cross-config figures are added."""

    metrics: dict[str, Any]
    tokens: list[list[int]]
    trace: RoutingTrace
    decode_steps: set[int]
    num_slots: int
    total_experts: int
    prefill_steps: set[int]
    # expert parallelism: rank -> (layer, expert) -> owned, for the per-rank bound (latency.py)
    placement: Any = None


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
        self.prefill = dict.fromkeys(_COUNTERS, 0.0)  # prompt steps of the timed pass
        self.prefill_steps: set[int] = set()
        self._scheduled: list[Any] = []
        scheduler = self.engine.scheduler
        original = scheduler.schedule  # bound method; the instance attribute shadows it

        def schedule() -> Any:  # records which request each token of the step belongs to
            out = original()
            self._scheduled = list(out.scheduled)
            recorder.token_requests = [
                s.request.request_id for s in out.scheduled for _ in range(s.num_new_tokens)
            ]
            return out

        scheduler.schedule = schedule
        self._unwrap = lambda: delattr(scheduler, "schedule")

    def close(self) -> None:
        """Give the scheduler back its own schedule()."""
        self._unwrap()

    def _stats(self) -> dict[str, float]:
        # the engine's own counters, read around every step: not offload_stats(), which also
        # gathers every expert-parallel rank's (two collectives a step for nothing)
        d = self.engine.runner.stats.to_dict()
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
                ttft = sum(step_s)  # engine steps only: the counter reads in between are not
            if timed and before is not None:
                after = self._stats()
                into = self.counters if is_decode else self.prefill
                for k in _COUNTERS:
                    into[k] += after[k] - before[k]
                (self.decode_steps if is_decode else self.prefill_steps).add(self.step)
            self.step += 1
            self.bar.update(1)
        wall = sum(step_s)
        short = [r for r in reqs if len(r.output_token_ids) < max_tokens]
        if short:  # the engine fails a request whose step raised, and keeps going
            err = getattr(self.engine, "last_error", None)
            raise RuntimeError(
                f"request {short[0].request_id} finished after {len(short[0].output_token_ids)} "
                f"of {max_tokens} tokens ({short[0].finish_reason}): {err!r}"
            ) from err
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


def run_budget(
    path: Path,
    budget: str,
    s: LatencySettings,
    routings: list[tuple[str, RoutingSource | None]],
    prompts: list[list[int]],
    warm_prompts: list[list[int]],
) -> list[ConfigRun]:
    """Load the model once at `budget` and measure it under each routing in turn."""
    from moetier import LLM
    from moetier.errors import ConfigError

    if s.llm_kwargs.get("expert_parallel_size", 1) > 1 and any(src for _, src in routings):
        # every rank routes with its own replicated routers; an override on rank 0 only would
        # make the ranks compute different experts
        raise ConfigError(
            "bench latency --expert-parallel-size runs the model's own routers: pass "
            "--routing model"
        )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    t_load = time.perf_counter()
    from moetier.bench.latency import GPU_MEMORY_LABEL

    split = budget.startswith(GPU_MEMORY_LABEL)  # the memory split decides the expert budget
    if split:
        extra: dict[str, Any] = {"gpu_memory": budget[len(GPU_MEMORY_LABEL) :]}
    else:  # the 100% reference and explicit budgets keep the engine's own KV sizing
        extra = {"expert_budget": None if budget == "100%" else budget}
    llm = LLM(
        str(path),
        host_budget=s.host_budget,
        device=s.device,
        dtype=s.dtype,
        seed=s.seed,
        policy=s.policy,
        progress=False,
        # Fixed work per run: a prompt measured again (the greedy check's, another routing's)
        # must not reuse K/V (a routing override would even change it). bench k=v may set it.
        **{"enable_prefix_caching": False, **s.llm_kwargs, **extra},
    )
    load_s = time.perf_counter() - t_load
    try:
        # the model's own routing, before any override: what transformers and the other
        # budgets are checked against (greedy, so an ulp of difference cannot flip a sample)
        greedy = _greedy_tokens(llm, prompts[0])
        runs = [
            measure(llm, budget, s, spec, source, prompts, warm_prompts, load_s)
            for spec, source in routings
        ]
        if greedy:
            runs[0].metrics["greedy_tokens"] = greedy
        return runs
    finally:
        llm.close()  # an expert-parallel group's other ranks exit
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:  # give cached pinned host memory back before the next load
                host_empty()


def measure(
    llm: Any,
    budget: str,
    s: LatencySettings,
    spec: str,
    source: RoutingSource | None,
    prompts: list[list[int]],
    warm_prompts: list[list[int]],
    load_s: float,
) -> ConfigRun:
    """One (budget, routing) configuration (see the module docstring for the protocol)."""
    from tqdm.auto import tqdm

    device: torch.device = llm.engine.runner.device
    blocks = llm.engine.runner.model.moe_blocks()
    undo = install(blocks, source) if source is not None else None
    if source is not None:
        source.reset()
    plan = llm.offload_stats()
    header = TraceHeader(
        int(llm.engine.runner.hf_config.num_hidden_layers),
        int(llm.engine.runner.num_experts),
        int(llm.engine.runner.top_k),
        [int(b.layer) for b in blocks],
        int(plan["expert_bytes"]),
    )
    recorder = TraceRecorder(header)
    # Recording needs the routing ids on the host, which an all-resident step never fetches (no
    # routing sync, CUDA-graph replays): recording it would time a slower path than users get.
    # Its trace is not needed either: with every expert resident Belady misses nothing.
    if plan["device_slots"] < plan["total_experts"]:
        recorder.attach(blocks)
    b = s.batch_size
    iters = max(1, math.ceil(s.num_prompts / b))
    warm_tokens = min(8, s.output_len)
    total = s.warmup * warm_tokens + iters * s.output_len
    desc = f"{budget} {spec.split(':')[0]}"
    bar = tqdm(total=total, desc=desc, unit="step", disable=not s.progress, file=sys.stderr)
    driver = _Driver(llm, recorder, bar)
    try:
        for w in range(s.warmup):
            driver.run(warm_prompts[:b], warm_tokens, s.seed + 10_000 + w * b, timed=False)
        llm.engine.runner.stats.reset()
        ranks_before = llm.rank_stats()  # [] for one rank
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        its = [
            driver.run(prompts[i * b : (i + 1) * b], s.output_len, s.seed + i * b, timed=True)
            for i in range(iters)
        ]
        recorder.detach()
        ranks = _rank_rows(
            ranks_before, llm.rank_stats(), sum(len(t) for it in its for t in it.tokens)
        )
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
        driver.close()
        recorder.detach()
        if undo is not None:
            undo()
    metrics = _metrics(its, driver, device_time, plan, budget, load_s)
    label = source.label if source is not None else "model routers"
    metrics.update(
        routing=spec, routing_label=label, peak_device_bytes=peak_dev, peak_host_rss_bytes=peak_rss
    )
    if ranks:
        metrics["ranks"] = ranks
    return ConfigRun(
        metrics,
        [t for it in its for t in it.tokens],
        recorder.trace,
        driver.decode_steps,
        int(plan["device_slots"]),
        int(plan["total_experts"]),
        driver.prefill_steps,
        None if llm.engine.runner.parallel is None else llm.engine.runner.parallel.placement,
    )


_RANK_COUNTERS = (
    "requests", "device_hits", "host_hits", "disk_reads", "bytes_host_to_device",
    "bytes_disk_to_host", "exposed_fetch_s", "collective_calls", "collective_s",
    "collective_bytes", "decode_steps", "prefill_steps",
)  # fmt: skip


def _rank_rows(
    before: list[dict[str, Any]], after: list[dict[str, Any]], tokens: int
) -> list[dict[str, Any]]:
    """Per expert-parallel rank, over the timed pass: the experts it owns, its slots, its
    tier counters and collective time, and per generated token its link and disk bytes,
    exposed fetch and collective time (every rank runs every step)."""
    rows = []
    per = max(tokens, 1)
    for b, a in zip(before, after):
        d = {k: a[k] - b[k] for k in _RANK_COUNTERS}
        lookups = max(d["requests"], 1)
        rows.append(
            dict(
                rank=int(a["rank"]),
                owned_experts=int(a["owned_experts"]),
                device_slots=int(a["device_slots"]),
                **d,
                hit_rate=d["device_hits"] / lookups,
                h2d_mb_per_token=d["bytes_host_to_device"] / per / 1e6,
                disk_mb_per_token=d["bytes_disk_to_host"] / per / 1e6,
                exposed_fetch_ms_per_token=d["exposed_fetch_s"] * 1e3 / per,
                collective_ms_per_token=d["collective_s"] * 1e3 / per,
            )
        )
    return rows


def _greedy_tokens(llm: Any, prompt: list[int]) -> list[int]:
    """Greedy tokens of the first prompt with the model's routers: every budget's are compared
    with the 100% run's, and the 100% run's with transformers."""
    from moetier import SamplingParams

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
    plan: dict[str, Any],
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
        top_kernels = [list(k) for k in device_time.top_kernels]
    else:  # CPU: the compute device is the host, so a step is all "busy"
        gpu_busy, launches, copy_ms = tpot, 0.0, 0.0
        top_kernels = []
    lookups = max(c["requests"], 1.0)
    pre, iters = driver.prefill, max(len(its), 1)
    return dict(
        budget=budget,
        device_slots=int(plan["device_slots"]),
        total_experts=int(plan["total_experts"]),
        budget_fraction=plan["device_slots"] / max(plan["total_experts"], 1),
        budget_bytes=int(plan["device_slots"] * plan["expert_bytes"]),
        host_rows=int(plan["host_rows"]),
        expert_bytes=int(plan["expert_bytes"]),
        expert_format=str(plan["expert_format"]),  # how experts are stored and moved
        kv_cache_dtype=str(plan["kv_cache_dtype"]),  # the effective KV storage format
        kv_bytes_per_token=int(plan["kv_bytes_per_token"]),
        kv_blocks=int(plan["kv_blocks_total"]),
        kv_cache_bytes=int(plan["kv_cache_bytes"]),
        # the memory split (None unless --gpu-memory): the budget, each side's bytes, the rule
        gpu_memory_bytes=plan.get("gpu_memory_bytes"),
        split_expert_bytes=plan.get("split_expert_bytes"),
        split_kv_bytes=plan.get("split_kv_bytes"),
        split_reason=plan.get("split_reason"),
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
        top_kernels=top_kernels,  # [name, ms per step, launches per step], heaviest first
        host_overhead_ms=tpot - gpu_busy,
        exposed_fetch_ms_per_token=c["exposed_fetch_s"] * 1e3 / n,
        h2d_bytes_per_token=c["bytes_host_to_device"] / n,
        disk_bytes_per_token=c["bytes_disk_to_host"] / n,
        lookups_per_token=c["requests"] / n,
        misses_per_token=(c["requests"] - c["device_hits"]) / n,
        # All-resident steps look slots up on the device (resident_lookups), never in requests.
        device_hit_rate=(
            c["device_hits"] / lookups if c["requests"] or not c["resident_lookups"] else 1.0
        ),
        miss_host_ms_per_token=c["miss_host_s"] * 1e3 / n,
        routing_sync_ms_per_token=c["routing_sync_s"] * 1e3 / n,
        host_hit_rate=c["host_hits"] / lookups,
        disk_read_rate=c["disk_reads"] / lookups,
        # The prompt steps (TTFT) of one timed batch: expert bytes moved, time compute waited.
        prefill_h2d_bytes=pre["bytes_host_to_device"] / iters,
        prefill_disk_bytes=pre["bytes_disk_to_host"] / iters,
        prefill_exposed_fetch_ms=pre["exposed_fetch_s"] * 1e3 / iters,
        prefill_miss_host_ms=pre["miss_host_s"] * 1e3 / iters,
        # Steps of the timed pass replayed as CUDA graphs (prompt steps: fresh prompts only).
        decode_graph_replays=int(c["decode_graph_replays"] + pre["decode_graph_replays"]),
        prefill_graph_replays=int(c["prefill_graph_replays"] + pre["prefill_graph_replays"]),
        # Prefetch counters over the timed decode steps (all 0 with prefetch off).
        **{k: int(c[k]) for k in _COUNTERS if k.startswith("prefetch")},
    )
