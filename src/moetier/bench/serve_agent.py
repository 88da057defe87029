"""`moetier bench serve --workload agent`: multi-turn agent conversations against a server.

Owns the client side of the agent workload: each conversation resends its whole history every
turn (the previous prompt, the model's answer, then a new tool result), one request at a time,
with the server's /metrics counters read around every request, so each turn's prefix-cache
queries and hits and its expert bytes are that turn's alone. After each turn a *fresh* request
whose prompt is only that turn's new tokens (the answer and the tool result) gives the baseline
the issue's target compares with. The summary per turn and its markdown table are here; the
server and flags are serve_cli.py's, the requests serve.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moetier.bench.serve import (
    RequestResult,
    ServeBenchRun,
    request_record,
    send_request,
    server_counters,
)
from moetier.bench.serve_data import AgentConversation, BenchPrompt
from moetier.errors import ConfigError

# Counter deltas kept per request (names as serve.parse_metrics gives them).
_TURN_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "bytes_host_to_device",
    "bytes_disk_to_host",
    "exposed_fetch_s",
    "expert_lookups",
)


@dataclass
class _History:
    """A conversation so far, as the endpoint sends it: token ids or chat messages."""

    ids: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


def _turn_prompt(
    run: ServeBenchRun, conv: AgentConversation, turn: int, h: _History, answer: RequestResult
) -> tuple[BenchPrompt, BenchPrompt]:
    """(the turn's whole-history request, the fresh request of only its new tokens); `h` grows
    by the turn's new part. Turn 1's fresh request is turn 1 itself (nothing to reuse)."""
    out = conv.output_len
    if turn == 1:
        if run.endpoint == "chat":
            h.messages = [{"role": "user", "content": conv.first}]
            p = BenchPrompt("", conv.first_len, out, list(h.messages))
        else:
            assert isinstance(conv.first, list)
            h.ids = list(conv.first)
            p = BenchPrompt(list(h.ids), len(h.ids), out)
        return p, p
    tool = conv.tool_results[turn - 2]
    if run.endpoint == "chat":
        assert isinstance(tool, str)
        h.messages += [
            {"role": "assistant", "content": answer.output_text},
            {"role": "tool", "content": tool, "tool_call_id": f"call_{turn - 1}"},
        ]
        new_len = answer.output_tokens + conv.tool_result_len
        fresh_msg = [{"role": "user", "content": answer.output_text + "\n" + tool}]
        whole = BenchPrompt("", 0, out, list(h.messages))
        return whole, BenchPrompt("", new_len, 1, fresh_msg)
    assert isinstance(tool, list)
    new = list(answer.output_ids) + tool
    h.ids += new
    return BenchPrompt(list(h.ids), len(h.ids), out), BenchPrompt(new, len(new), 1)


def _delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    if not before or not after:
        return {}
    return {k: after[k] - before.get(k, 0.0) for k in _TURN_COUNTERS if k in after}


async def _timed(
    client: Any, run: ServeBenchRun, p: BenchPrompt, index: int
) -> tuple[RequestResult, dict[str, float]]:
    """One request with the server counters' deltas over it."""
    before = await server_counters(client, run.base_url)
    res = await send_request(client, run, p, index)
    after = await server_counters(client, run.base_url)
    return res, _delta(before, after)


async def run_conversation(
    client: Any, run: ServeBenchRun, conv: AgentConversation, ci: int, fresh: bool
) -> list[dict[str, Any]]:
    """Every turn of one conversation, in order; one record per turn."""
    h, answer, rows = _History(), RequestResult(), []
    for turn in range(1, conv.turns + 1):
        whole, new = _turn_prompt(run, conv, turn, h, answer)
        index = ci * conv.turns + turn - 1
        answer, counters = await _timed(client, run, whole, index)
        if not answer.ok:
            raise ConfigError(f"conversation {ci} turn {turn} failed: {answer.error}")
        row: dict[str, Any] = {
            "conversation": ci,
            "turn": turn,
            "new_tokens": answer.prompt_len if turn == 1 else new.prompt_len,
            "request": request_record(answer),
            "counters": counters,
            "output_ids": answer.output_ids,
        }
        if fresh and turn > 1:
            base, base_counters = await _timed(client, run, new, 1_000_000 + index)
            if not base.ok:
                raise ConfigError(f"conversation {ci} turn {turn} fresh request: {base.error}")
            row["fresh"] = request_record(base) | {"counters": base_counters}
        rows.append(row)
    return rows


def _median_ms(values: list[float]) -> float:
    arr = [v for v in values if not math.isnan(v)]
    return float(np.median(arr)) * 1000.0 if arr else math.nan


def summarize_turns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per turn over conversations: median TTFT and fresh TTFT (ms), their ratio, the summed
    prefix-cache queries and hits and their rate, mean expert bytes, mean cached_tokens."""
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        rs = [r for r in rows if r["turn"] == turn]
        n = len(rs)

        def total(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
            vals = [r["counters"].get(key) for r in rs]
            return sum(vals) if vals and all(v is not None for v in vals) else None

        queries, hits = total("prefix_cache_queries"), total("prefix_cache_hits")
        fresh = [r["fresh"] for r in rs if "fresh" in r]
        s: dict[str, Any] = {
            "turn": turn,
            "conversations": n,
            "prompt_tokens_median": float(np.median([r["request"]["prompt_len"] for r in rs])),
            "new_tokens_median": float(np.median([r["new_tokens"] for r in rs])),
            "ttft_median_ms": _median_ms([r["request"]["ttft"] for r in rs]),
            "e2el_median_ms": _median_ms([r["request"]["e2el"] for r in rs]),
            "fresh_ttft_median_ms": _median_ms([f["ttft"] for f in fresh]) if fresh else None,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_hit_rate": hits / queries if queries and hits is not None else None,
            "cached_tokens_mean": _mean([r["request"]["cached_tokens"] for r in rs]),
        }
        for key in ("bytes_host_to_device", "bytes_disk_to_host", "exposed_fetch_s"):
            value = total(key)
            s[f"{key}_mean"] = value / n if value is not None else None
        if fresh:
            s["fresh_bytes_host_to_device_mean"] = _mean(
                [f["counters"].get("bytes_host_to_device") for f in fresh]
            )
            s["fresh_prefix_cache_hits"] = sum(
                f["counters"].get("prefix_cache_hits", 0.0) for f in fresh
            )
        base = s["fresh_ttft_median_ms"]
        s["ttft_over_fresh"] = s["ttft_median_ms"] / base if base else None
        out.append(s)
    return out


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals and len(vals) == len(values) else None


async def run_agent(
    run: ServeBenchRun,
    conversations: list[AgentConversation],
    fresh: bool = True,
    warm: list[AgentConversation] | None = None,
) -> dict[str, Any]:
    """Warm-up, then every conversation one after another (one request in flight). The
    warm-up plays the `warm` conversations whole (fresh requests too), else sends run.warmup
    of run.prompts; nothing of it is recorded."""
    import httpx

    if not conversations:
        raise ConfigError("no conversations to send (--num-prompts must be at least 1)")
    timeout = httpx.Timeout(run.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        if warm is not None:
            for wi, conv in enumerate(warm):
                await run_conversation(client, run, conv, -1 - wi, fresh)
        else:
            for i in range(run.warmup):
                p = run.prompts[i % len(run.prompts)]
                res = await send_request(client, run, p, -1 - i)
                if not res.ok:
                    raise ConfigError(f"warm-up request failed: {res.error}")
        gauges = await server_counters(client, run.base_url) or {}
        rows = []
        for ci, conv in enumerate(conversations):
            rows += await run_conversation(client, run, conv, ci, fresh)
    return {
        "turns": summarize_turns(rows),
        "requests": rows,
        "device_slots": gauges.get("device_slots"),
        "kv_blocks_total": gauges.get("kv_blocks_total"),
    }


def compare_outputs(on: dict[str, Any], off: dict[str, Any]) -> None:
    """Mark each turn of `on` with whether its output ids equal the prefix-off run's, and put
    the off run's TTFT beside it."""
    ids_off = {(r["conversation"], r["turn"]): r["output_ids"] for r in off["requests"]}
    for s, s_off in zip(on["turns"], off["turns"]):
        rs = [r for r in on["requests"] if r["turn"] == s["turn"]]
        s["tokens_match_prefix_off"] = all(
            r["output_ids"] == ids_off.get((r["conversation"], r["turn"])) for r in rs
        )
        s["prefix_off_ttft_median_ms"] = s_off["ttft_median_ms"]
        s["prefix_off_bytes_host_to_device_mean"] = s_off["bytes_host_to_device_mean"]


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def agent_table(result: dict[str, Any]) -> str:
    """Markdown: settings line, then one row per turn."""
    s = result["settings"]
    turns = result["agent"]["turns"]
    off = any("prefix_off_ttft_median_ms" in t for t in turns)
    lines = [
        f"model {s['model']} ({s['served_model_name']}), device {s['device']}, dtype "
        f"{s['dtype']}, expert budget {s['expert_budget']}, host budget {s['host_budget']}, "
        f"agent workload: {s['num_prompts']} conversations x {s['turns']} turns, first prompt "
        f"{s['input_len_desc']} tokens, tool result {s['tool_result_len']} tokens, answer "
        f"{s['output_len_desc']} tokens, endpoint {s['endpoint']}, seed {s['seed']}",
        "",
        "| turn | prompt tok | new tok | TTFT med ms | fresh TTFT med ms | TTFT / fresh "
        "| prefix queries | prefix hits | hit rate | cached_tokens | h2d bytes | disk bytes "
        "| fresh h2d bytes |" + (" prefix-off TTFT med ms | tokens = prefix off |" if off else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---|" if off else ""),
    ]
    for t in turns:
        row = (
            f"| {t['turn']} | {_f(t['prompt_tokens_median'], 0)} | {_f(t['new_tokens_median'], 0)} "
            f"| {_f(t['ttft_median_ms'])} | {_f(t['fresh_ttft_median_ms'])} "
            f"| {_f(t['ttft_over_fresh'], 2)} | {_f(t['prefix_cache_queries'], 0)} "
            f"| {_f(t['prefix_cache_hits'], 0)} | {_f(t['prefix_hit_rate'], 3)} "
            f"| {_f(t['cached_tokens_mean'], 0)} | {_f(t['bytes_host_to_device_mean'], 0)} "
            f"| {_f(t['bytes_disk_to_host_mean'], 0)} "
            f"| {_f(t.get('fresh_bytes_host_to_device_mean'), 0)} |"
        )
        if off:
            match = t.get("tokens_match_prefix_off")
            row += (
                f" {_f(t.get('prefix_off_ttft_median_ms'))} "
                f"| {'-' if match is None else 'yes' if match else 'NO'} |"
            )
        lines.append(row)
    return "\n".join(lines)
