"""`moetier bench serve` measurement: streamed requests against an OpenAI-compatible server.

Owns the client side of the serving benchmark: request scheduling (concurrency cap, Poisson
arrivals), per-chunk timing (TTFT, inter-token latency, TPOT, end-to-end), the summary per
concurrency level, the server's /metrics offload counters before and after each level, and the
markdown table. Starting and stopping a server and the flags are in serve_cli.py; prompts in
serve_data.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moetier.bench.serve_data import BenchPrompt
from moetier.errors import ConfigError

# /metrics samples (without the model_name label) read before and after each level.
_COUNTER_KEYS = {
    "moetier:expert_lookups_total": "expert_lookups",
    'moetier:expert_hits_total{tier="device"}': "device_hits",
    'moetier:expert_hits_total{tier="host"}': "host_hits",
    'moetier:expert_hits_total{tier="disk"}': "disk_reads",
    'moetier:expert_evictions_total{tier="device"}': "device_evictions",
    'moetier:expert_bytes_total{path="disk_to_host"}': "bytes_disk_to_host",
    'moetier:expert_bytes_total{path="host_to_device"}': "bytes_host_to_device",
    "moetier:expert_exposed_fetch_seconds_total": "exposed_fetch_s",
    "moetier:expert_disk_read_seconds_total": "disk_read_s",
    "moetier:expert_resident_lookups_total": "resident_lookups",
    "moetier:expert_miss_host_seconds_total": "miss_host_s",
    "moetier:expert_routing_sync_seconds_total": "routing_sync_s",
    "moetier:num_preemptions_total": "preemptions",
    "moetier:generation_tokens_total": "generation_tokens",
    "moetier:prompt_tokens_total": "prompt_tokens",
    "moetier:prefix_cache_queries_total": "prefix_cache_queries",
    "moetier:prefix_cache_hits_total": "prefix_cache_hits",
    'moetier:engine_steps_total{step="decode"}': "decode_steps",
    'moetier:engine_steps_total{step="prefill"}': "prefill_steps",
}
_STEPS = ("decode", "prefill")
_ROUTING = ("host", "device")


def _moe_call_keys() -> dict[str, str]:
    """Per MoE layer call counters by routing (host: distinct measured; device: the all-resident
    table, distinct not measured) and step kind, under the engine's offload_stats() names."""
    out = {}
    for step in _STEPS:
        for routing in _ROUTING:
            labels = f'{{routing="{routing}",step="{step}"}}'
            out["moetier:moe_layer_calls_total" + labels] = f"moe_calls_{routing}_{step}"
            out["moetier:expert_token_lookups_total" + labels] = f"token_lookups_{routing}_{step}"
        labels = f'{{routing="host",step="{step}"}}'
        out["moetier:expert_distinct_lookups_total" + labels] = f"distinct_lookups_host_{step}"
    return out


_COUNTER_KEYS.update(_moe_call_keys())
_GAUGE_KEYS = {
    "moetier:expert_device_slots": "device_slots",
    "moetier:kv_cache_blocks_total": "kv_blocks_total",
}
_LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One streamed request as the client saw it (times in seconds from its send)."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0  # the workload's count; usage.prompt_tokens when the server sends it
    output_tokens: int = 0
    expected_tokens: int = 0
    ttft: float = math.nan
    e2el: float = math.nan
    itl: list[float] = field(default_factory=list)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens when sent
    output_ids: list[int] = field(default_factory=list)  # streamed token ids
    output_text: str = ""
    sent_at: float = math.nan  # time.perf_counter() at the send
    # time.perf_counter() of each streamed token's chunk (a chunk of k tokens: k equal times)
    token_times: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass
class ServeBenchRun:
    """Client settings of one run (the server's own settings are recorded by the caller)."""

    base_url: str
    model: str
    endpoint: str  # chat | completions
    prompts: list[BenchPrompt]
    concurrencies: list[int]
    request_rate: float = math.inf
    seed: int = 0
    temperature: float = 1.0
    api_key: str | None = None
    warmup: int = 1
    request_timeout_s: float = 3600.0
    progress: bool = True


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _payload(run: ServeBenchRun, p: BenchPrompt, index: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": run.model,
        "max_tokens": p.output_len,
        "temperature": run.temperature,
        "seed": run.seed * 1_000_003 + index,  # the same tokens at every concurrency level
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if run.endpoint == "chat" and p.messages is not None:
        body["messages"] = p.messages
        return "/v1/chat/completions", body
    if run.endpoint == "chat":
        text = p.prompt if isinstance(p.prompt, str) else ""
        if not text:
            raise ConfigError("the chat endpoint needs text prompts")
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = p.prompt
    return "/v1/completions", body


def _chunk_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """Tokens a streamed choice carries: its token ids (vLLM's return_token_ids), else one per
    non-empty text piece."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if _chunk_text(choice) else 0


def _usage(res: RequestResult, usage: dict[str, Any]) -> int:
    """Take prompt and cached tokens from a usage object; its completion tokens."""
    res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])
    return int(usage["completion_tokens"])


async def send_request(
    client: Any,
    run: ServeBenchRun,
    p: BenchPrompt,
    index: int,
    on_tokens: Callable[[int], None] | None = None,
) -> RequestResult:
    """Stream one request; time each chunk that carries tokens. `on_tokens`, when given, is
    called with the tokens streamed so far after each such chunk."""
    path, body = _payload(run, p, index)
    res = RequestResult(prompt_len=p.prompt_len, expected_tokens=p.output_len)
    usage_tokens: int | None = None
    t0 = res.sent_at = time.perf_counter()
    last = t0
    try:
        async with client.stream(
            "POST", run.base_url + path, json=body, headers=_headers(run.api_key)
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message", msg["error"]))
                    return res
                usage = msg.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = _usage(res, usage)
                choices = msg.get("choices") or []
                for c in choices:
                    res.output_ids += c.get("token_ids") or []
                    res.output_text += _chunk_text(c)
                n = sum(_chunk_tokens(c) for c in choices)
                if n == 0:
                    continue
                now = time.perf_counter()
                if res.output_tokens == 0:
                    res.ttft = now - t0
                else:
                    # A chunk with k tokens (text held back by the detokenizer) counts k gaps of
                    # gap/k each, as the server's own inter-token histogram does.
                    res.itl += [(now - last) / n] * n
                res.output_tokens += n
                res.token_times += [now] * n
                last = now
                if on_tokens is not None:
                    on_tokens(res.output_tokens)
        res.e2el = time.perf_counter() - t0
        if usage_tokens is not None:
            res.output_tokens = usage_tokens
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as exc:  # noqa: BLE001 - one failed request is a counted failure
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _stat(values: list[float]) -> dict[str, float]:
    arr = np.array([v for v in values if not math.isnan(v)], dtype=float) * 1000.0
    if arr.size == 0:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p99": float(np.percentile(arr, 99)),
    }


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Latency statistics (ms) and throughputs of one level's requests."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_len_mismatch": sum(r.output_tokens != r.expected_tokens for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s
        if duration_s > 0
        else math.nan,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name in _LATENCIES:
        for stat, value in _stat(series[name]).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def parse_metrics(text: str) -> dict[str, float]:
    """The offload and token counters of a Prometheus /metrics page (summed over model names)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (
                "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            name = _COUNTER_KEYS.get(key) or _GAUGE_KEYS.get(key)
            if name is not None:
                out[name] = out.get(name, 0.0) + float(s.value)
    return out


async def server_counters(client: Any, base_url: str) -> dict[str, float] | None:
    """Fresh counters: /health?check=true makes a moetier server pull them from the engine
    (and verify its KV blocks and expert slots); then /metrics is read. None when unavailable."""
    try:
        await client.get(f"{base_url}/health", params={"check": "true"})
        r = await client.get(f"{base_url}/metrics")
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)
    except Exception:  # noqa: BLE001 - a server without /metrics still gets a latency result
        return None


def offload_delta(
    before: dict[str, float] | None, after: dict[str, float] | None, output_tokens: int
) -> dict[str, Any] | None:
    """Counter deltas over one level and lookups per output token (None without counters)."""
    if not before or not after:
        return None
    delta: dict[str, Any] = {
        k: after[k] - before.get(k, 0.0) for k in _COUNTER_KEYS.values() if k in after
    }
    for k in _GAUGE_KEYS.values():
        if k in after:
            delta[k] = after[k]
    lookups = delta.get("expert_lookups")
    if lookups is not None and output_tokens:
        delta["expert_lookups_per_output_token"] = lookups / output_tokens
    if lookups:
        delta["device_hit_rate"] = delta.get("device_hits", 0.0) / lookups
    if "decode_steps" in delta:
        delta.update(dedup_per_step(delta))
    return delta


def dedup_per_step(c: dict[str, float]) -> dict[str, float | None]:
    """Distinct experts per decode step (summed over its MoE layers) against the sum over the
    step's requests of the experts each asked for (top-k per request on a decode step), from
    the MoE calls routed on the host, the only ones whose distinct experts the server measures
    (None when there were none, e.g. every expert resident). Prefill's ratio also includes the
    dedup within each prompt."""
    steps = c["decode_steps"] + c["prefill_steps"]
    calls = sum(c.get(f"moe_calls_{r}_{s}", 0.0) for r in _ROUTING for s in _STEPS)
    out: dict[str, float | None] = {
        "engine_steps": steps,
        "moe_layers_per_step": calls / steps if steps else None,
        "token_lookups": sum(
            c.get(f"token_lookups_{r}_{s}", 0.0) for r in _ROUTING for s in _STEPS
        ),
    }
    host_calls = c.get("moe_calls_host_decode", 0.0)
    pairs = c.get("token_lookups_host_decode", 0.0)
    distinct = c.get("distinct_lookups_host_decode", 0.0)
    measured = host_calls / (calls / steps) if host_calls and calls else 0.0  # decode steps
    out["decode_steps_measured"] = measured
    out["distinct_per_decode_step"] = distinct / measured if measured else None
    out["sum_over_requests_per_decode_step"] = pairs / measured if measured else None
    out["decode_distinct_over_sum"] = distinct / pairs if pairs else None
    prefill_pairs = c.get("token_lookups_host_prefill", 0.0)
    out["prefill_distinct_over_lookups"] = (
        c.get("distinct_lookups_host_prefill", 0.0) / prefill_pairs if prefill_pairs else None
    )
    return out


def add_sharing(levels: list[dict[str, Any]]) -> None:
    """`distinct_over_sum`: distinct experts against the sum over requests. Measured on decode
    steps when the server counts them (`decode_distinct_over_sum`); otherwise (an older server,
    or no decode call routed on the host) estimated from the concurrency-1 level: there every
    step serves one request, so its lookups per output token are what each request costs alone
    (same prompts, same seeded tokens)."""
    alone = next((lv for lv in levels if lv["max_concurrency"] == 1 and lv.get("offload")), None)
    per_token = alone["offload"].get("expert_lookups_per_output_token") if alone else None
    for lv in levels:
        off = lv.get("offload")
        if off and off.get("decode_distinct_over_sum") is not None:
            off["distinct_over_sum"] = off["decode_distinct_over_sum"]
            off["distinct_over_sum_source"] = "measured on decode steps"
            continue
        if not off or not per_token or "expert_lookups" not in off:
            continue
        est_sum = per_token * lv["total_output_tokens"]
        off["est_lookups_sum_over_requests"] = est_sum
        off["distinct_over_sum"] = off["expert_lookups"] / est_sum if est_sum else math.nan
        off["distinct_over_sum_source"] = "estimated from concurrency 1"


def request_record(r: RequestResult) -> dict[str, Any]:
    """One request for the JSON: lengths, latencies (s) and error; not its tokens or gaps."""
    skip = ("itl", "output_ids", "output_text", "sent_at", "token_times")
    return {k: v for k, v in asdict(r).items() if k not in skip} | {"tpot": r.tpot}


async def _arrivals(n: int, rate: float, rng: random.Random) -> Any:
    for i in range(n):
        yield i
        if math.isfinite(rate) and rate > 0 and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def _run_level(client: Any, run: ServeBenchRun, concurrency: int) -> dict[str, Any]:
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(
        total=len(run.prompts),
        desc=f"concurrency {concurrency}",
        unit="req",
        disable=not run.progress,
        leave=False,
    )

    async def one(i: int) -> RequestResult:
        async with sem:
            res = await send_request(client, run, run.prompts[i], i)
        bar.update(1)
        return res

    before = await server_counters(client, run.base_url)
    rng = random.Random(run.seed)
    t0 = time.perf_counter()
    tasks = [
        asyncio.create_task(one(i))
        async for i in _arrivals(len(run.prompts), run.request_rate, rng)
    ]
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    bar.close()
    after = await server_counters(client, run.base_url)
    level: dict[str, Any] = {"max_concurrency": concurrency, **summarize(results, duration)}
    level["offload"] = offload_delta(before, after, level["total_output_tokens"])
    level["offload_counters_before"] = before
    level["offload_counters_after"] = after
    level["requests"] = [request_record(r) for r in results]
    return level


async def run_bench(run: ServeBenchRun) -> list[dict[str, Any]]:
    """Warm-up, then every concurrency level in turn over the same prompts."""
    import httpx

    if not run.prompts:
        raise ConfigError("no prompts to send (--num-prompts must be at least 1)")
    limits = httpx.Limits(max_connections=max(run.concurrencies) + 4)
    timeout = httpx.Timeout(run.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        for i in range(run.warmup):
            res = await send_request(client, run, run.prompts[i % len(run.prompts)], -1 - i)
            if not res.ok:
                raise ConfigError(f"warm-up request failed: {res.error}")
        levels = [await _run_level(client, run, c) for c in run.concurrencies]
    add_sharing(levels)
    return levels


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def serve_table(result: dict[str, Any]) -> str:
    """Markdown: settings line, latency table, throughput and offload table."""
    s = result["settings"]
    lines = [
        f"model {s['model']} ({s['served_model_name']}), device {s['device']}, "
        f"dtype {s['dtype']}, expert budget {s['expert_budget']}, host budget "
        f"{s['host_budget']}, {s['dataset']} prompts x{s['num_prompts']} "
        f"(input {s['input_len_desc']}, output {s['output_len_desc']}), request rate "
        f"{s['request_rate']}, endpoint {s['endpoint']}, seed {s['seed']}",
        "",
        "| conc | ok | fail | TTFT mean / med / p99 ms | TPOT mean / med / p99 ms "
        "| ITL mean / med / p99 ms | E2E mean / med / p99 ms |",
        "|---:|---:|---:|---|---|---|---|",
    ]
    for lv in result["results"]:
        cells = [
            " / ".join(_f(lv[f"{st}_{name}_ms"]) for st in ("mean", "median", "p99"))
            for name in _LATENCIES
        ]
        lines.append(
            f"| {lv['max_concurrency']} | {lv['completed']} | {lv['failed']} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "| conc | req/s | out tok/s | total tok/s | out tokens | len mismatch "
        "| expert lookups | lookups / out token | distinct / sum over requests "
        "| device hit rate | exposed fetch s | preemptions |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["results"]:
        off = lv.get("offload") or {}
        lines.append(
            f"| {lv['max_concurrency']} | {_f(lv['request_throughput'], 3)} "
            f"| {_f(lv['output_throughput'], 2)} | {_f(lv['total_token_throughput'], 2)} "
            f"| {lv['total_output_tokens']} | {lv['output_len_mismatch']} "
            f"| {_f(off.get('expert_lookups'), 0)} "
            f"| {_f(off.get('expert_lookups_per_output_token'), 1)} "
            f"| {_f(off.get('distinct_over_sum'), 3)} | {_f(off.get('device_hit_rate'), 3)} "
            f"| {_f(off.get('exposed_fetch_s'), 2)} | {_f(off.get('preemptions'), 0)} |"
        )
    return "\n".join(lines + _dedup_table(result["results"]))


def _dedup_table(levels: list[dict[str, Any]]) -> list[str]:
    """Per level: engine steps, distinct experts per decode step against the sum over requests
    (host-routed MoE calls only; '-' where the server measured none)."""
    rows = [lv for lv in levels if (lv.get("offload") or {}).get("engine_steps") is not None]
    if not rows:
        return []
    lines = [
        "",
        "| conc | steps (decode / prefill) | MoE layers / step | distinct experts / decode step "
        "| sum over requests / decode step | distinct / sum | prefill distinct / lookups |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in rows:
        off = lv["offload"]
        lines.append(
            f"| {lv['max_concurrency']} | {_f(off['engine_steps'], 0)} "
            f"({_f(off['decode_steps'], 0)} / {_f(off['prefill_steps'], 0)}) "
            f"| {_f(off.get('moe_layers_per_step'), 0)} "
            f"| {_f(off.get('distinct_per_decode_step'), 1)} "
            f"| {_f(off.get('sum_over_requests_per_decode_step'), 1)} "
            f"| {_f(off.get('decode_distinct_over_sum'), 3)} "
            f"| {_f(off.get('prefill_distinct_over_lookups'), 3)} |"
        )
    return lines
