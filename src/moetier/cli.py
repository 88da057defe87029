"""Command line: `moetier generate | routing-stats | serve` — argument parsing only.

Each subcommand hands off to the library; errors a user can fix print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from moetier.bench.cli import add_bench_parser
from moetier.config import (
    DEVICE_CACHE_HELP,
    GPU_MEMORY_HELP,
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    STREAM_COPY_NOW_HELP,
    STREAM_EVICTION_HELP,
    OffloadConfig,
    format_bytes,
)
from moetier.demo.cli import add_demo_parsers
from moetier.errors import ConfigError, MoetierError
from moetier.parallel.args import add_parallel_args, parallel_kwargs
from moetier.server.cli import (
    PREFETCH_HELP,
    PREFIX_CACHING_HELP,
    TOKENIZER_HELP,
    add_serve_parser,
)
from moetier.threads import THREADS_HELP, threads_arg


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or .gguf file (default: the built-in demo model)",
    )
    p.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    p.add_argument(
        "--expert-budget",
        default=None,
        help="device slots for routed experts: bytes ('6GiB') or a share ('25%%'); default: all",
    )
    p.add_argument("--gpu-memory", default=None, help=GPU_MEMORY_HELP)
    p.add_argument(
        "--host-budget",
        default=None,
        help="host RAM for routed experts; below the routed bytes means disk reads "
        "(default: all on CUDA, none on CPU)",
    )
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
    p.add_argument("--prefetch-ahead", type=int, default=1, help="MoE layers ahead to prefetch")
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
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=PREFIX_CACHING_HELP,
    )
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP
    )
    add_parallel_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetier", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from one prompt")
    _add_model_args(gen)
    gen.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="the model as a positional argument (same as --model)")  # fmt: skip
    gen.add_argument("--prompt", default="What is the capital of France?")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--no-chat",
        action="store_true",
        help="send the prompt as raw text instead of through the chat template",
    )
    gen.set_defaults(func=cmd_generate)
    rs = sub.add_parser("routing-stats", help="per-layer expert reuse and popularity over prompts")
    rs.add_argument("--model", default=None, help="model directory (default: the demo model)")
    rs.add_argument("--prompts-file", default=None, help="one prompt per line (default: built-in)")
    rs.add_argument("--max-new-tokens", type=int, default=32)
    rs.set_defaults(func=cmd_routing_stats)
    add_demo_parsers(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from moetier import LLM, SamplingParams

    # Sampling flags are checked before the model loads (a typo should not cost a load).
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.model is not None and args.model_path is not None:
        raise ConfigError("give the model once: as MODEL or as --model")
    start = time.perf_counter()
    llm = LLM(
        args.model or args.model_path,
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
        seed=args.seed or 0,
        threads=args.threads,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory=args.gpu_memory,
        # one prompt, one sequence: --gpu-memory gives the KV one full-length sequence and the
        # experts the rest (the trace objective assumes a server keeping many running)
        max_num_seqs=1,
        **parallel_kwargs(args),
    )
    load_s = time.perf_counter() - start
    has_template = llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None)
    start = time.perf_counter()
    if has_template and not args.no_chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate([args.prompt], params)[0]
    gen_s = time.perf_counter() - start
    print(out.outputs[0].text)
    print(
        summary_line(len(out.outputs[0].token_ids), gen_s, load_s, llm.offload_stats()),
        file=sys.stderr,
    )
    return 0


def summary_line(n_tokens: int, gen_s: float, load_s: float, s: dict[str, Any]) -> str:
    moved = s["bytes_disk_to_host"] + s["bytes_host_to_device"]
    return (
        f"[moetier] {n_tokens} tokens in {gen_s:.2f} s ({n_tokens / max(gen_s, 1e-9):.2f} tok/s, "
        f"load {load_s:.1f} s) | experts: {int(s['device_slots'])}/{int(s['total_experts'])} "
        f"slots, hits device {s['device_hit_rate']:.1%} host {s['host_hit_rate']:.1%} "
        f"disk {s['disk_read_rate']:.1%} | moved {format_bytes(moved)} "
        f"(disk->host {format_bytes(s['bytes_disk_to_host'])}, host->device "
        f"{format_bytes(s['bytes_host_to_device'])}) | exposed fetch {s['exposed_fetch_s']:.3f} s, "
        f"miss handling {s['miss_host_s']:.3f} s, routing-sync wait {s['routing_sync_s']:.3f} s"
        f" | {dedup_summary(s)}{ranks_summary(s)}"
    )


def ranks_summary(s: dict[str, Any]) -> str:
    """Expert parallelism: each rank's slots of its own experts, hit rate and exchange time
    (the figures before it are rank 0's); "" for one rank."""
    ranks = s.get("ranks") or []
    rows = [
        f"rank {r['rank']} {int(r['device_slots'])}/{int(r['owned_experts'])} slots, hits "
        f"{r['device_hit_rate']:.1%}, exchange {r['collective_s']:.3f} s"
        for r in ranks
    ]
    return f" | {len(ranks)} ranks (figures above: rank 0's): " + "; ".join(rows) if rows else ""


def dedup_summary(s: dict[str, float]) -> str:
    """Engine steps, (token, expert) lookups before the per-step dedup, and the distinct
    experts of the MoE calls routed on the host (the all-resident path does not measure them)."""
    pairs = sum(s[f"token_lookups_host_{k}"] for k in ("decode", "prefill"))
    distinct = sum(s[f"distinct_lookups_host_{k}"] for k in ("decode", "prefill"))
    head = (
        f"{int(s['engine_steps'])} steps ({int(s['decode_steps'])} decode), "
        f"{int(s['token_lookups'])} expert lookups before dedup"
    )
    if not pairs:
        return head + ", distinct not measured (all resident)"
    return head + f", distinct {int(distinct)} of {int(pairs)} host-routed ({distinct / pairs:.1%})"


def cmd_routing_stats(args: argparse.Namespace) -> int:
    from moetier.bench.routing import run_routing_stats

    prompts = None
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    print(run_routing_stats(args.model, prompts, args.max_new_tokens))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except MoetierError as exc:
        print(f"moetier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
