"""`moetier bench serve --workload contention`: one long prefill arriving while others decode.

Owns the client side of the protocol's contention scenario: `decoders` streamed requests start
together; once each has streamed `contention_after` tokens, one long prompt is sent. Every
decoder token's arrival time is kept, and the decoders' inter-token latencies are split into
three windows around the long request: before it was sent, during (from its send until its first
token), after. The largest decoder gap overlapping the window, against one chunk's estimated
compute (the long request's TTFT over the chunks its prompt needs), says whether chunked prefill
kept decode moving. The window arithmetic and the markdown table are here; the server and flags
are serve_cli.py's, the requests serve.py's. No server-side counters: this is client timing only.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np

from moetier.bench.serve import RequestResult, ServeBenchRun, request_record, send_request
from moetier.bench.serve_data import BenchPrompt
from moetier.errors import ConfigError

WINDOWS = ("before", "during", "after")


def _window(t: float, t_send: float, t_first: float) -> str:
    """A token's window by its arrival: before the send, up to and including the long
    request's first token, or after it."""
    if t < t_send:
        return "before"
    return "during" if t <= t_first else "after"


def _ms_stats(gaps_s: list[float]) -> dict[str, float | None]:
    if not gaps_s:
        return {"p50": None, "p99": None, "max": None}
    arr = np.array(gaps_s, dtype=float) * 1000.0
    return {
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def window_stats(arrivals: list[list[float]], t_send: float, t_first: float) -> dict[str, Any]:
    """Per window: the decoders' tokens arriving in it, their inter-token gaps (ms: p50, p99,
    max; a chunk of k tokens counts k gaps of gap/k, as serve.py's ITL does; each decoder's first
    token has none) and the largest raw gap (ms) between two token chunks of one decoder that
    overlaps the during window (it may start before the send or end after the first token: a
    decoder stalled across the whole prefill shows as one gap longer than the window)."""
    tokens = dict.fromkeys(WINDOWS, 0)
    gaps: dict[str, list[float]] = {w: [] for w in WINDOWS}
    max_gap: float | None = None
    for times in arrivals:
        prev: float | None = None
        i = 0
        while i < len(times):
            t = times[i]
            k = 1
            while i + k < len(times) and times[i + k] == t:  # one chunk of k tokens
                k += 1
            w = _window(t, t_send, t_first)
            tokens[w] += k
            if prev is not None:
                gaps[w] += [(t - prev) / k] * k
                if prev < t_first and t > t_send:
                    max_gap = max(max_gap or 0.0, t - prev)
            prev = t
            i += k
    out: dict[str, Any] = {}
    for w in WINDOWS:
        out[w] = {"tokens": tokens[w], "gaps": len(gaps[w])} | {
            f"itl_{k}_ms": v for k, v in _ms_stats(gaps[w]).items()
        }
    out["max_gap_during_ms"] = max_gap * 1000.0 if max_gap is not None else None
    return out


def contention_summary(
    arrivals: list[list[float]],
    t_send: float,
    long_ttft_s: float,
    long_prompt_len: int,
    chunk_tokens: int,
) -> dict[str, Any]:
    """The windows, the long request's TTFT, its chunks (ceil(prompt / chunk)), one chunk's
    estimated compute (TTFT / chunks) and stall_over_chunk: the largest decoder gap over the
    during window against that estimate (<= ~1 means decode waited at most one chunk)."""
    assert chunk_tokens >= 1 and long_prompt_len >= 1
    t_first = t_send + long_ttft_s
    out = window_stats(arrivals, t_send, t_first)
    chunks = math.ceil(long_prompt_len / chunk_tokens)
    chunk_ms = long_ttft_s * 1000.0 / chunks
    gap = out["max_gap_during_ms"]
    out.update(
        long_ttft_ms=long_ttft_s * 1000.0,
        long_prompt_tokens=long_prompt_len,
        chunk_tokens=chunk_tokens,
        chunks=chunks,
        chunk_estimate_ms=chunk_ms,
        stall_over_chunk=gap / chunk_ms if gap is not None and chunk_ms > 0 else None,
        # A decoder that finished before the long request's first token could not show a stall.
        decoders_decoding_through=sum(1 for ts in arrivals if ts and ts[-1] > t_first),
    )
    return out


async def _decoders_then_long(
    client: Any, run: ServeBenchRun, decoders: list[BenchPrompt], long: BenchPrompt, after: int
) -> tuple[list[RequestResult], RequestResult]:
    """Start every decoder; once each has streamed `after` tokens, send `long`."""
    ready = [asyncio.Event() for _ in decoders]

    def mark(i: int) -> Any:
        def seen(n: int) -> None:
            if n >= after:
                ready[i].set()

        return seen

    tasks = [
        asyncio.create_task(send_request(client, run, p, i, mark(i)))
        for i, p in enumerate(decoders)
    ]
    waits = [asyncio.create_task(e.wait()) for e in ready]
    # A decoder that ends (or fails) before its `after` tokens must not leave us waiting.
    pending = set(waits)
    while pending:
        done, _ = await asyncio.wait(pending | set(tasks), return_when=asyncio.FIRST_COMPLETED)
        if any(t in done for t in tasks) and not all(e.is_set() for e in ready):
            for t in waits:
                t.cancel()
            results = await asyncio.gather(*tasks)
            errors = [r.error for r in results if not r.ok]
            raise ConfigError(
                f"a decoder ended before streaming {after} tokens "
                f"({errors[0] if errors else 'too few tokens'}): raise --output-len above "
                "--contention-after"
            )
        pending -= done
    long_res = await send_request(client, run, long, len(decoders))
    return list(await asyncio.gather(*tasks)), long_res


async def run_contention(
    run: ServeBenchRun,
    decoders: list[BenchPrompt],
    long: BenchPrompt,
    after: int,
    chunk_tokens: int,
) -> dict[str, Any]:
    """Warm-up, then the decoders and the long request; the summary, each request's record and
    each decoder's token arrival times (ms from the long request's send). With run.warmup > 0
    the warm-up plays the scenario once on run.prompts (the decoders' prompts, then the long
    one, none of them the timed ones)."""
    import httpx

    limits = httpx.Limits(max_connections=len(decoders) + 4)
    timeout = httpx.Timeout(run.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if run.warmup > 0:
            *warm_dec, warm_long = run.prompts
            warm, warm_long_res = await _decoders_then_long(
                client, run, warm_dec, warm_long, after
            )  # fmt: skip
            failed = [r for r in [*warm, warm_long_res] if not r.ok]
            if failed:
                raise ConfigError(f"warm-up request failed: {failed[0].error}")
        dec, long_res = await _decoders_then_long(client, run, decoders, long, after)
    for i, r in enumerate(dec):
        if not r.ok:
            raise ConfigError(f"decoder {i} failed: {r.error}")
    if not long_res.ok:
        raise ConfigError(f"the long request failed: {long_res.error}")
    arrivals = [r.token_times for r in dec]
    t_send = long_res.sent_at
    summary = contention_summary(arrivals, t_send, long_res.ttft, long_res.prompt_len, chunk_tokens)
    return {
        "summary": summary,
        "decoders": [request_record(r) for r in dec],
        "long": request_record(long_res),
        "arrivals_ms": [[(t - t_send) * 1000.0 for t in ts] for ts in arrivals],
    }


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def contention_table(result: dict[str, Any]) -> str:
    """Markdown: settings line, one row per window, then the long request's row."""
    s, c = result["settings"], result["contention"]["summary"]
    lines = [
        f"model {s['model']} ({s['served_model_name']}), device {s['device']}, dtype "
        f"{s['dtype']}, expert budget {s['expert_budget']}, host budget {s['host_budget']}, "
        f"contention workload: {s['decoders']} decoders ({s['input_len_desc']}-token prompts, "
        f"{s['output_len_desc']} tokens each), long prompt {s['long_len']} tokens sent after "
        f"{s['contention_after']} decoder tokens, chunk {s['chunk_tokens']} tokens "
        f"({s['chunk_tokens_source']}), endpoint {s['endpoint']}, seed {s['seed']}",
        "",
        "| window | decoder tokens | ITL p50 ms | ITL p99 ms | ITL max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for w in WINDOWS:
        x = c[w]
        lines.append(
            f"| {w} | {x['tokens']} | {_f(x['itl_p50_ms'])} | {_f(x['itl_p99_ms'])} "
            f"| {_f(x['itl_max_ms'])} |"
        )
    lines += [
        "",
        "| long TTFT ms | chunks | one chunk est. ms | largest decoder gap during ms "
        "| stall / chunk | decoders decoding through |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {_f(c['long_ttft_ms'])} | {c['chunks']} | {_f(c['chunk_estimate_ms'])} "
        f"| {_f(c['max_gap_during_ms'])} | {_f(c['stall_over_chunk'], 2)} "
        f"| {c['decoders_decoding_through']} / {s['decoders']} |",
    ]
    return "\n".join(lines)


def contention_notes() -> list[str]:
    return [
        "windows by a decoder token's arrival: before the long request's send, during (send to "
        "its first token, inclusive), after; ITL as elsewhere (a chunk of k tokens counts k "
        "gaps of gap/k), each decoder's first token has no gap.",
        "largest decoder gap during: the longest time between two token chunks of one decoder "
        "that overlaps the during window; one chunk est.: long TTFT / chunks (ceil(long prompt / "
        "max_num_batched_tokens)), which includes the decode tokens sharing each step; stall / "
        "chunk <= ~1 means decode waited at most one chunk's compute.",
    ]
