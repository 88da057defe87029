"""`moetier serve [MODEL]`: argument parsing and start-up checks; serving is in app.py.

Refuses a non-loopback bind without an API key unless told to knowingly; never logs the key.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetier.config import (
    DEFAULT_MAX_NUM_SEQS,
    DEVICE_CACHE_HELP,
    GPU_MEMORY_HELP,
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    ROUTING_TRACE_HELP,
    STREAM_COPY_NOW_HELP,
    STREAM_EVICTION_HELP,
    OffloadConfig,
)
from moetier.errors import ConfigError
from moetier.parallel.args import add_parallel_args, parallel_kwargs
from moetier.threads import THREADS_HELP, threads_arg
from moetier.tools.parsers import tool_parsers

log = logging.getLogger(__name__)

_PUBLIC_FLAG = "--allow-public-without-key"
TOKENIZER_HELP = (
    "Hugging Face tokenizer (directory or hub name) used instead of the model's own: for GGUF "
    "files whose tokenizer cannot be built from the file (GLM-4.5, DeepSeek)"
)
PREFETCH_HELP = (
    "next-layer expert prefetch: a predictor of offload/predict.py (same-index, last-call, "
    "activation, gate-lookahead, hash); hash-routed layers (DeepSeek-V4) are prefetched "
    "exactly with any of them, `hash` alone; default: off; only acts when experts are offloaded"
)
PREFIX_CACHING_HELP = (
    "reuse the KV blocks of earlier requests' identical prompt prefixes instead of recomputing "
    "them (exact; default: on)"
)
# Once the shutdown grace period is over, in-flight requests get their final error event (or 503)
# and this long to send it; uvicorn then cancels whatever is still running.
_FLUSH_S = 5.0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument(
        "model", nargs="?", default=None, help="model directory or .gguf file (default: demo model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--expert-budget", default=None, help="device slots for routed experts")
    p.add_argument("--host-budget", default=None, help="host RAM for routed experts")
    p.add_argument("--gpu-memory", default=None, help=GPU_MEMORY_HELP)
    p.add_argument("--routing-trace", default=None, help=ROUTING_TRACE_HELP)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument(
        "--policy",
        default="lru",
        help=(
            "expert-cache policy (lru, lfu, lfru, least-stale, layer-lru, activation, "
            "step-lru, hazard)"
        ),
    )
    p.add_argument("--prefetch", default=None, help=PREFETCH_HELP)
    p.add_argument("--prefetch-ahead", type=_positive, default=1,
                   help="MoE layers ahead to prefetch")  # fmt: skip
    p.add_argument("--device-cache", action="store_true", help=DEVICE_CACHE_HELP)
    p.add_argument(
        "--stream-eviction",
        action=argparse.BooleanOptionalAction,
        default=OffloadConfig.stream_eviction,
        help=STREAM_EVICTION_HELP,
    )
    p.add_argument(
        "--stream-copy-now",
        action=argparse.BooleanOptionalAction,
        default=OffloadConfig.stream_copy_now,
        help=STREAM_COPY_NOW_HELP,
    )
    p.add_argument("--threads", type=threads_arg, default=None, help=THREADS_HELP)
    add_parallel_args(p)
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1 routes "
                   "(default: $MOETIER_API_KEY)")  # fmt: skip
    p.add_argument(_PUBLIC_FLAG, action="store_true",
                   help="allow a non-loopback bind with no API key")  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="model id clients send")
    p.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    p.add_argument("--max-num-seqs", type=_positive, default=None,
                   help=f"running batch size (default {DEFAULT_MAX_NUM_SEQS}; unset, "
                   "--gpu-memory with --routing-trace may size the KV for fewer)")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=_positive, default=4096)
    p.add_argument("--max-waiting", type=_non_negative, default=256,
                   help="queued requests beyond the batch before 429")  # fmt: skip
    p.add_argument("--max-model-len", type=_positive, default=None)
    p.add_argument("--num-kv-blocks", type=_positive, default=None)
    p.add_argument("--kv-block-size", type=_positive, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help=PREFIX_CACHING_HELP)  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help=KV_CACHE_DTYPE_HELP)  # fmt: skip
    p.add_argument("--max-body-bytes", type=_positive, default=4 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-call-parser", choices=sorted(tool_parsers()), default=None,
                   help="format of the model's tool calls (default: detected from its chat "
                   "template)")  # fmt: skip
    p.add_argument("--shutdown-grace-s", type=_non_negative_float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may finish before they end "
                   "with an error event (streams) or a 503")  # fmt: skip
    p.set_defaults(func=cmd_serve)
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, allow_public: bool) -> None:
    if not is_loopback(host) and not api_key and not allow_public:
        raise ConfigError(
            f"refusing to serve on {host} without an API key: pass --api-key (or set "
            f"MOETIER_API_KEY), or {_PUBLIC_FLAG} to serve without one knowingly"
        )


def _graceful_server_class() -> Any:
    import uvicorn

    class GracefulServer(uvicorn.Server):  # type: ignore[misc]
        """SIGTERM/SIGINT stop accepting and let in-flight requests finish for `grace_s`; then
        `on_grace_over()` ends the rest (each gets a final error event or a 503) and they have
        _FLUSH_S to send it. Then `run` returns, so the engine is shut down and the process
        exits 0; uvicorn would otherwise re-raise the signal after its own shutdown."""

        def __init__(
            self, config: uvicorn.Config, grace_s: float, on_grace_over: Callable[[], None]
        ) -> None:
            config.timeout_graceful_shutdown = math.ceil(grace_s + _FLUSH_S)
            super().__init__(config)
            self.grace_s, self.on_grace_over = grace_s, on_grace_over

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, self.on_grace_over)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return GracefulServer


def _end_in_flight(client: Any, grace_s: float) -> None:
    """The grace period is over: end what is still running with an error the client sees."""
    message = (
        f"server shutting down: the request did not finish within the {grace_s:g} s "
        f"shutdown grace period (--shutdown-grace-s)"
    )
    ended = client.end_all(message)
    if ended:
        log.warning("shutdown grace period over: ended %d in-flight request(s)", ended)


def _engine_args(args: argparse.Namespace) -> Any:
    from moetier.server.engine_process import EngineArgs

    return EngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        expert_budget=args.expert_budget,
        host_budget=args.host_budget,
        device=args.device,
        dtype=args.dtype,
        policy=args.policy,
        prefetch=args.prefetch,
        prefetch_ahead=args.prefetch_ahead,
        device_cache=args.device_cache,
        stream_eviction=args.stream_eviction,
        stream_copy_now=args.stream_copy_now,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        kv_block_size=args.kv_block_size,
        max_model_len=args.max_model_len,
        threads=args.threads,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory=args.gpu_memory,
        routing_trace=args.routing_trace,
        **parallel_kwargs(args),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from moetier.llm import load_tokenizer_or_reason
    from moetier.metrics import ServerMetrics
    from moetier.parallel.group import torchrun_rank
    from moetier.server.app import ServerSettings, create_app
    from moetier.server.engine_process import EngineClient, build_llm

    if args.expert_parallel_size > 1 and torchrun_rank() not in (None, 0):
        build_llm(_engine_args(args))  # torchrun's other ranks follow rank 0's engine, then exit
        return 0
    server_cls = _graceful_server_class()
    api_key = args.api_key or os.environ.get("MOETIER_API_KEY") or None
    check_bind(args.host, api_key, args.allow_public_without_key)
    client = EngineClient(_engine_args(args), logging.getLogger().getEffectiveLevel())
    try:
        info = client.start()
        name = args.served_model_name or (
            Path(info["model"]).name if args.model else "moetier-demo"
        )
        metrics = ServerMetrics(
            name,
            kv_cache_dtype=str(info.get("kv_cache_dtype", "")),
            expert_format=(str(info.get("expert_format", "")), int(info.get("expert_bytes", 0))),
            split_reason=str(info.get("split_reason", "")),
        )
        client.on_stats = metrics.update_engine
        settings = ServerSettings(
            name,
            api_key,
            int(info.get("max_num_seqs", args.max_num_seqs or DEFAULT_MAX_NUM_SEQS)),
            args.max_waiting,
            args.max_body_bytes,
            args.tool_call_parser,
        )
        # none: token-id prompts only
        tokenizer, _ = load_tokenizer_or_reason(info["model"], args.tokenizer)
        app = create_app(client, tokenizer, settings, metrics)
        log.warning(
            "serving %s on http://%s:%d (auth %s)",
            name,
            args.host,
            args.port,
            "on" if api_key else "off",
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
        )
        grace = args.shutdown_grace_s
        server_cls(config, grace, lambda: _end_in_flight(client, grace)).run()
    finally:
        client.shutdown()
    return 0
