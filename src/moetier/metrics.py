"""Prometheus export of engine and offload counters under the `moetier:` prefix.

Owns the metric names and their registry; reads plain dicts and latencies handed to it and never
imports anything else from the package (no engine, no tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)  # fmt: skip

_STEPS_DOC = (
    "Engine steps that ran the model: step=decode when every request adds one token, "
    "step=prefill when any prompt chunk runs"
)
_REPLAYS_DOC = (
    "Forwards replayed as CUDA graphs: step=decode for decode steps, step=prefill for fresh "
    "prompts (one per step, within the largest bucket); the rest ran eagerly"
)
_CALLS_DOC = (
    "MoE layer calls; routing=host: routing ids synced to the host (distinct experts measured), "
    "routing=device: all-resident slot table, no sync (distinct experts not measured)"
)
_TOKEN_LOOKUPS_DOC = (
    "(token, expert) pairs the MoE layer calls asked for before the per-step dedup across the "
    "batch, i.e. summed over the step's requests"
)
_DISTINCT_DOC = (
    "Distinct experts per MoE layer call after the per-step dedup, summed; measured only in "
    "routing=host calls (the all-resident path would need a host sync), so compare it with "
    "moetier:expert_token_lookups{routing=host} of the same step kind"
)
_PREFETCH_DOC = (
    "Expert prefetches (--prefetch): issued; used by a later fetch before eviction; in_time = "
    "ready when the compute needed them; cancelled before their copy ran"
)
# Engine snapshot key -> (metric name, help, labels) for monotonically growing totals.
_COUNTERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "requests": (
        "moetier:expert_lookups",
        "Expert cache lookups: one per distinct expert per MoE layer call routed on the host",
        {},
    ),
    "device_hits": ("moetier:expert_hits", "Expert lookups served by a tier", {"tier": "device"}),
    "host_hits": ("moetier:expert_hits", "Expert lookups served by a tier", {"tier": "host"}),
    "disk_reads": ("moetier:expert_hits", "Expert lookups served by a tier", {"tier": "disk"}),
    "evictions": ("moetier:expert_evictions", "Experts evicted from a tier", {"tier": "device"}),
    "host_evictions": ("moetier:expert_evictions", "Experts evicted from a tier", {"tier": "host"}),
    "bytes_disk_to_host": ("moetier:expert_bytes", "Expert bytes moved", {"path": "disk_to_host"}),
    "bytes_host_to_device": (
        "moetier:expert_bytes",
        "Expert bytes moved",
        {"path": "host_to_device"},
    ),
    "exposed_fetch_s": (
        "moetier:expert_exposed_fetch_seconds",
        "Time compute waited for expert data",
        {},
    ),
    "disk_read_s": ("moetier:expert_disk_read_seconds", "Time spent reading expert shards", {}),
    "resident_lookups": (
        "moetier:expert_resident_lookups",
        "(token, expert) lookups served by the all-resident device slot table (no host decision)",
        {},
    ),
    "miss_host_s": ("moetier:expert_miss_host_seconds", "Host time handling expert misses", {}),
    "routing_sync_s": (
        "moetier:expert_routing_sync_seconds",
        "Host time waiting at MoE routing syncs",
        {},
    ),
    "num_preemptions": ("moetier:num_preemptions", "Requests preempted (KV blocks ran out)", {}),
    "prefix_cache_queries": (
        "moetier:prefix_cache_queries",
        "Tokens of admitted requests looked up in the KV prefix cache",
        {},
    ),
    "prefix_cache_hits": (
        "moetier:prefix_cache_hits",
        "Tokens of admitted requests found in the KV prefix cache (not recomputed)",
        {},
    ),
    "prefetches_issued": ("moetier:expert_prefetches", _PREFETCH_DOC, {"outcome": "issued"}),
    "prefetches_used": ("moetier:expert_prefetches", _PREFETCH_DOC, {"outcome": "used"}),
    "prefetches_in_time": ("moetier:expert_prefetches", _PREFETCH_DOC, {"outcome": "in_time"}),
    "prefetches_cancelled": ("moetier:expert_prefetches", _PREFETCH_DOC, {"outcome": "cancelled"}),
    "prefetch_wasted_bytes": (
        "moetier:expert_prefetch_wasted_bytes",
        "Bytes prefetched for experts evicted or cancelled before any use",
        {},
    ),
    "decode_steps": ("moetier:engine_steps", _STEPS_DOC, {"step": "decode"}),
    "prefill_steps": ("moetier:engine_steps", _STEPS_DOC, {"step": "prefill"}),
    "decode_graph_replays": ("moetier:cuda_graph_replays", _REPLAYS_DOC, {"step": "decode"}),
    "prefill_graph_replays": ("moetier:cuda_graph_replays", _REPLAYS_DOC, {"step": "prefill"}),
}


def _moe_call_counters() -> dict[str, tuple[str, str, dict[str, str]]]:
    """Per MoE layer call counters, by where routing was resolved and the kind of engine step
    (snapshot keys as `OffloadStats` names them)."""
    out = {}
    for step in ("decode", "prefill"):
        for routing in ("host", "device"):
            labels = {"routing": routing, "step": step}
            out[f"moe_calls_{routing}_{step}"] = ("moetier:moe_layer_calls", _CALLS_DOC, labels)
            out[f"token_lookups_{routing}_{step}"] = (
                "moetier:expert_token_lookups",
                _TOKEN_LOOKUPS_DOC,
                labels,
            )
        out[f"distinct_lookups_host_{step}"] = (
            "moetier:expert_distinct_lookups",
            _DISTINCT_DOC,
            {"routing": "host", "step": step},
        )
    return out


_COUNTERS.update(_moe_call_counters())
_PREFETCH_DOC = (
    "Expert prefetches (--prefetch): issued; used by a later fetch before eviction; in_time = "
    "ready when the compute needed them; cancelled before their copy ran"
)
# Engine snapshot key -> (metric name, help) for current values.
_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_running": ("moetier:num_requests_running", "Requests in the running batch"),
    "num_requests_waiting": ("moetier:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_blocks_used": ("moetier:kv_cache_blocks_used", "KV cache blocks held by requests"),
    "kv_blocks_free": (
        "moetier:kv_cache_blocks_free",
        "KV cache blocks an allocation can take (cached blocks no request holds included)",
    ),
    "kv_blocks_cached": (
        "moetier:kv_cache_blocks_cached",
        "KV cache blocks kept for prefix reuse that no request holds (evictable)",
    ),
    "kv_blocks_total": ("moetier:kv_cache_blocks_total", "KV cache blocks in the pool"),
    "kv_bytes_per_token": (
        "moetier:kv_cache_bytes_per_token",
        "KV cache bytes one token takes over all layers, as stored (int8/fp8 scales included)",
    ),
    "kv_cache_bytes": (
        "moetier:kv_cache_bytes",
        "Bytes of the KV cache pools (allocated at start)",
    ),
    "device_slots": ("moetier:expert_device_slots", "Device expert slots in the pool"),
    "gpu_memory_bytes": (
        "moetier:gpu_memory_bytes",
        "The --gpu-memory budget split between weights, reserve, expert slots and KV (0: none)",
    ),
    "split_expert_bytes": (
        "moetier:memory_split_expert_bytes",
        "Bytes of the device expert slots the memory split chose (slots x slot bytes)",
    ),
    "split_kv_bytes": (
        "moetier:memory_split_kv_bytes",
        "Bytes of the KV blocks the memory split chose (blocks x block bytes)",
    ),
}


# Per-rank snapshot keys "rank{r}.{key}" (expert parallelism, engine.py RANK_METRIC_KEYS) ->
# (metric name, help, labels besides model_name and rank); counters unless listed as gauges.
_RANK_METRICS: dict[str, tuple[str, str, dict[str, str]]] = {
    "device_hits": (
        "moetier:rank_expert_hits",
        "Expert lookups of a rank by tier",
        {"tier": "device"},
    ),
    "host_hits": ("moetier:rank_expert_hits", "Expert lookups of a rank by tier", {"tier": "host"}),
    "disk_reads": (
        "moetier:rank_expert_hits",
        "Expert lookups of a rank by tier",
        {"tier": "disk"},
    ),
    "bytes_host_to_device": (
        "moetier:rank_expert_bytes",
        "Expert bytes a rank moved",
        {"path": "host_to_device"},
    ),
    "bytes_disk_to_host": (
        "moetier:rank_expert_bytes",
        "Expert bytes a rank moved",
        {"path": "disk_to_host"},
    ),
    "exposed_fetch_s": (
        "moetier:rank_expert_exposed_fetch_seconds",
        "Time a rank's compute waited for experts",
        {},
    ),
    "collective_calls": ("moetier:rank_collectives", "MoE-layer exchanges of a rank", {}),
    "collective_s": ("moetier:rank_collective_seconds", "Time a rank spent in exchanges", {}),
    "collective_bytes": ("moetier:rank_collective_bytes", "Bytes a rank contributed", {}),
    "owned_experts": ("moetier:rank_owned_experts", "Routed experts a rank owns", {}),
    "device_slots": ("moetier:rank_device_slots", "Expert slots of a rank", {}),
}
_RANK_GAUGES = {"owned_experts", "device_slots"}


def _rank_families(model: str, snap: Mapping[str, float]) -> Iterator[Metric]:
    """The per-rank families of a snapshot, one sample per (rank, labels)."""
    fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for full, value in sorted(snap.items()):
        rank, dot, key = full.partition(".")
        if not dot or not rank.startswith("rank") or key not in _RANK_METRICS:
            continue
        name, doc, labels = _RANK_METRICS[key]
        fam = fams.get(name)
        if fam is None:
            cls = GaugeMetricFamily if key in _RANK_GAUGES else CounterMetricFamily
            fam = fams[name] = cls(name, doc, labels=["model_name", "rank", *labels])
        fam.add_metric([model, rank.removeprefix("rank"), *labels.values()], float(value))
    yield from fams.values()


class _SnapshotCollector(Collector):
    """Yields counters and gauges from the latest engine snapshot (replaced, never merged)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: dict[str, float] = {}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            snap = dict(self.snapshot)
        counters: dict[str, CounterMetricFamily] = {}
        for key, (name, doc, labels) in _COUNTERS.items():
            if key not in snap:
                continue
            fam = counters.get(name)
            if fam is None:
                fam = counters[name] = CounterMetricFamily(
                    name, doc, labels=["model_name", *labels]
                )
            fam.add_metric([self.model_name, *labels.values()], float(snap[key]))
        yield from counters.values()
        for key, (name, doc) in _GAUGES.items():
            if key in snap:
                gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
                gauge.add_metric([self.model_name], float(snap[key]))
                yield gauge
        yield from _rank_families(self.model_name, snap)


class ServerMetrics:
    """Request latencies observed by the server, plus the engine's latest counter snapshot."""

    def __init__(
        self,
        model_name: str,
        kv_cache_dtype: str = "",
        split_reason: str = "",
        expert_format: tuple[str, int] = ("", 0),
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        if kv_cache_dtype:
            # info-style: the engine's effective KV storage format as a label, value 1
            info = Gauge(
                "moetier:kv_cache_info",
                "The KV cache's effective storage format "
                "(kv_cache_dtype: bf16, fp16, fp32, int8, fp8)",
                ["model_name", "kv_cache_dtype"],
                registry=self.registry,
            )
            info.labels(model_name, kv_cache_dtype).set(1)
        if expert_format[0]:
            # info-style: how routed experts are stored and moved, value = bytes per expert
            fmt = Gauge(
                "moetier:expert_format_info",
                "Routed experts' storage format (expert_format: bf16, fp8_e4m3, ...); the "
                "value is one packed expert's bytes as stored, moved and cached",
                ["model_name", "expert_format"],
                registry=self.registry,
            )
            fmt.labels(model_name, expert_format[0]).set(expert_format[1])
        if split_reason:
            split = Gauge(
                "moetier:memory_split_info",
                "Why the memory split is what it is (split_reason: no_gpu_memory, explicit, "
                "expert_budget, num_kv_blocks, kv_request, trace)",
                ["model_name", "split_reason"],
                registry=self.registry,
            )
            split.labels(model_name, split_reason).set(1)
        self.ttft = Histogram(
            "moetier:time_to_first_token_seconds",
            "Time from request arrival to its first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "moetier:inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "moetier:e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "moetier:prompt_tokens", "Prompt tokens processed", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "moetier:generation_tokens", "Tokens generated", labels, registry=self.registry
        )
        self.requests = Counter(
            "moetier:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "moetier:request_rejected",
            "Requests refused before reaching the engine, by HTTP status",
            ["model_name", "status"],
            registry=self.registry,
        )
        self._snapshot = _SnapshotCollector(model_name)
        self.registry.register(self._snapshot)

    def update_engine(self, snapshot: Mapping[str, float]) -> None:
        with self._snapshot.lock:
            self._snapshot.snapshot = dict(snapshot)

    def engine_snapshot(self) -> dict[str, float]:
        with self._snapshot.lock:
            return dict(self._snapshot.snapshot)

    def observe_token(self, first: bool, since: float) -> None:
        """A token arrived `since` seconds after the request (first) or the previous token."""
        (self.ttft if first else self.itl).labels(self.model_name).observe(since)

    def observe_finish(self, reason: str, e2e: float, prompt: int, generated: int) -> None:
        self.e2e.labels(self.model_name).observe(e2e)
        self.requests.labels(self.model_name, reason).inc()
        self.prompt_tokens.labels(self.model_name).inc(prompt)
        self.generation_tokens.labels(self.model_name).inc(generated)

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()
