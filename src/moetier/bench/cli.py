"""`moetier bench latency | gate | serve | kv-formats | plot`: argument parsing for the bench,
then hand-off.

Owns the bench subcommands' flags only; the measurement lives in latency.py, gate.py,
serve.py and kv_formats.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moetier.bench.synthetic import FORMATS
from moetier.config import KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES
from moetier.parallel.args import add_parallel_args, parallel_kwargs
from moetier.threads import threads_arg

# LLM arguments that bench latency passes from its own flags: `--set` may name them instead
# (`--set policy=activation` is `--policy activation`); a flag given as well must agree.
_RUN_FLAGS = {"policy": "lru", "host_budget": None, "device": "auto", "dtype": "auto", "seed": 0}


def parse_kv(text: str) -> dict[str, Any]:
    """ "policy=lfu expert_budget=25% moe_grouped_kernel=false" -> dict (ints parsed, none=None)."""
    from moetier.errors import ConfigError

    out: dict[str, Any] = {}
    for item in text.split():
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} in {text!r}")
        key, value = item.split("=", 1)
        out[key.strip().replace("-", "_")] = _value(value)
    return out


def _value(v: str) -> Any:
    if v.lower() in ("none", "null"):
        return None
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v) if "." in v and not v.endswith("%") else v
    except ValueError:
        return v


def add_bench_parser(sub: Any) -> None:
    """Register `bench` and its subcommands on the top-level subparsers."""
    bench = sub.add_parser("bench", help="latency against the bound and the baselines; ship gate")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    lat = bsub.add_parser("latency", help="TTFT/TPOT per expert budget, with the bound")
    _add_latency_args(lat)
    lat.set_defaults(func=cmd_latency)
    gate = bsub.add_parser("gate", help="the ship gate: candidate vs baseline settings")
    _add_gate_args(gate)
    gate.set_defaults(func=cmd_gate)
    syn = bsub.add_parser(
        "synthetic", help="generate (once) a synthetic checkpoint; print its path"
    )
    syn.add_argument("shape")
    syn.add_argument("--layers", type=int, default=None)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--fill-device", default=None, help="default: cuda when available")
    syn.add_argument(
        "--format",
        default="bf16",
        choices=FORMATS,
        help="expert storage (fp8: e4m3, 128x128; gguf-*: one .gguf file, experts in that type)",
    )
    syn.set_defaults(func=cmd_synthetic)
    srv = bsub.add_parser(
        "serve", help="TTFT/TPOT/ITL and throughput through an OpenAI-compatible server"
    )
    from moetier.bench.serve_cli import add_serve_bench_args

    add_serve_bench_args(srv)
    kvf = bsub.add_parser(
        "kv-formats", help="KV bytes per token and greedy-token agreement per --kv-cache-dtype"
    )
    _add_kv_formats_args(kvf)
    kvf.set_defaults(func=cmd_kv_formats)
    plot = bsub.add_parser("plot", help="PNG plots from a saved latency result JSON")
    plot.add_argument("result", help="a --save-result JSON file")
    plot.add_argument("--out-dir", default=None, help="default: next to the JSON")
    plot.set_defaults(func=cmd_plot)


def _add_latency_args(p: argparse.ArgumentParser) -> None:
    add_parallel_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="Hugging Face model directory")
    src.add_argument(
        "--synthetic",
        default=None,
        help="synthetic shape (qwen3-30b-a3b, deepseek-v2-lite, mixtral-8x7b, olmoe-1b-7b, "
        "gpt-oss-20b, gpt-oss-120b (MXFP4 experts), qwen3.6-35b-a3b, gemma-4-26b-a4b, "
        "glm-4.5-air, deepseek-v4-flash (bf16; 13.2 GB a layer), tiny-qwen3, tiny-deepseek-v2, "
        "tiny-mixtral, tiny-gpt-oss, tiny-deepseek-v4, ...: bench/shapes.py), generated once "
        "under $MOETIER_HOME/synthetic",
    )
    p.add_argument("--layers", type=int, default=None, help="synthetic depth (default: real)")
    p.add_argument(
        "--format",
        default="bf16",
        choices=FORMATS,
        help="synthetic experts' storage format (fp8: e4m3 with 128x128 block scales)",
    )
    p.add_argument(
        "--expert-budget",
        default=None,
        help="comma-separated budgets run in one process; 100%% always runs first as reference "
        "(default 100%%,25%%,10%%; with --gpu-memory only 100%%)",
    )
    p.add_argument(
        "--gpu-memory",
        default=None,
        help="after the 100%% reference, one run whose device budget (bytes like 20GiB or a "
        "share like 90%%) is split between expert slots and KV blocks (README, 'One memory "
        "budget'); --kv-cache-dtype and --set max_model_len=... max_num_seqs=... feed the split",
    )
    p.add_argument("--host-budget", default=_RUN_FLAGS["host_budget"])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument(
        "--seed", type=int, default=_RUN_FLAGS["seed"], help="prompts, sampling, uniform routing"
    )
    p.add_argument(
        "--weights-seed", type=int, default=None, help="synthetic weights (default: --seed)"
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up batches per budget")
    p.add_argument(
        "--routing",
        default="model",
        help="model (the routers), uniform (seeded top-k draws) or trace:PATH (replay)",
    )
    p.add_argument("--policy", default=_RUN_FLAGS["policy"])
    p.add_argument(
        "--prefetch",
        default=None,
        help="prefetch predictor (default: off); trace: the next-layer predictions recorded in "
        "the version 2 trace of --routing trace:FILE",
    )
    p.add_argument("--device", default=_RUN_FLAGS["device"])
    p.add_argument("--dtype", default=_RUN_FLAGS["dtype"])
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None, help=KV_CACHE_DTYPE_HELP
    )
    p.add_argument(
        "--set",
        default="",
        metavar="K=V ...",
        help="extra LLM settings, e.g. 'moe_grouped_kernel=false'",
    )
    p.add_argument("--profile-steps", type=int, default=8, help="CUDA: decode steps profiled")
    p.add_argument(
        "--compare", default="", help="comma-separated baselines: transformers,accelerate"
    )
    p.add_argument("--accelerate-output-len", type=int, default=4)
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--save-trace", default=None, metavar="FILE.jsonl", help="100%% run's trace")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument(
        "--threads",
        type=threads_arg,
        default=None,
        help="torch CPU threads for moetier and the baselines: an integer >= 1 or auto "
        "(default: on the CPU, auto's count chosen once at the start; on CUDA, torch's choice)",
    )
    p.add_argument("--no-progress", action="store_true")


def _add_gate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", default="", help="k=v settings of the current default")
    p.add_argument("--candidate", required=True, help="k=v settings of the candidate")
    p.add_argument("--name", default=None, help="result file name (default: from the candidate)")
    p.add_argument("--shapes", default="tiny-qwen3,tiny-deepseek-v2")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seeds", default="0,1")
    p.add_argument(
        "--weights-seed",
        type=int,
        default=None,
        help="one synthetic checkpoint for every seed (default: each seed its own weights)",
    )
    p.add_argument("--expert-budget", default="25%", help="the budget both sides run at")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--routing", default="uniform")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--noise", type=float, default=0.05, help="tokens/s may drop by this share (0.05)"
    )
    p.add_argument(
        "--metric",
        choices=["decode", "prefill"],
        default="decode",
        help="rule 1 on exposed fetch per decode token (decode), or on TTFT (prefill: for a "
        "change to how prompts are run)",
    )
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--no-progress", action="store_true")


def _add_kv_formats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument(
        "--formats",
        default="auto,bf16,int8,fp8",
        help=f"comma-separated --kv-cache-dtype names ({', '.join(KV_CACHE_DTYPES)})",
    )
    p.add_argument("--reference", default="auto", help="the format the others are compared to")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy new tokens per prompt")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="the first N prompts (default: all)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--expert-budget", default=None, help="default: every expert resident")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--threads", type=threads_arg, default=None, help="torch CPU threads")
    p.add_argument("--set", default="", help='extra LLM(...) settings: "key=value key=value"')
    p.add_argument("--save-result", default=None, help="write the result JSON here")


def kv_formats_settings(args: argparse.Namespace) -> Any:
    from moetier.bench.kv_formats import KVFormatsSettings

    return KVFormatsSettings(
        model=args.model,
        formats=[f.strip() for f in args.formats.split(",") if f.strip()],
        reference=args.reference,
        max_tokens=args.max_tokens,
        num_prompts=args.num_prompts,
        device=args.device,
        dtype=args.dtype,
        expert_budget=args.expert_budget,
        max_num_seqs=args.max_num_seqs,
        llm_kwargs=parse_kv(args.set),
    )


def cmd_kv_formats(args: argparse.Namespace) -> int:
    from moetier.bench.kv_formats import kv_formats_table, run_kv_formats
    from moetier.bench.report import save_json

    settings = kv_formats_settings(args)
    threads = bench_threads(args.threads, settings.device)
    if threads is not None:
        settings.llm_kwargs.setdefault("threads", threads)
    result = run_kv_formats(settings, report=lambda line: print(line, file=sys.stderr))
    print(kv_formats_table(result))
    if args.save_result:
        save_json(args.save_result, result)
        print(f"\nsaved {args.save_result}", file=sys.stderr)
    return 0


def _with_prefetch(kwargs: dict[str, Any], prefetch: str | None) -> dict[str, Any]:
    """--prefetch NAME is `--set prefetch=NAME` (an explicit --set wins)."""
    if prefetch is not None:
        kwargs.setdefault("prefetch", prefetch)
    return kwargs


def _with_kv_dtype(kwargs: dict[str, Any], kv_cache_dtype: str | None) -> dict[str, Any]:
    """--kv-cache-dtype NAME is `--set kv_cache_dtype=NAME` (an explicit --set wins)."""
    if kv_cache_dtype is not None:
        kwargs.setdefault("kv_cache_dtype", kv_cache_dtype)
    return kwargs


def latency_budgets(expert_budget: str | None, gpu_memory: str | None) -> list[str]:
    """The --expert-budget list; with --gpu-memory the split decides the expert budget, so only
    the 100% reference may be named."""
    if expert_budget is None:
        return ["100%"] if gpu_memory else ["100%", "25%", "10%"]
    budgets = [b.strip() for b in expert_budget.split(",") if b.strip()]
    from moetier.errors import ConfigError

    if gpu_memory and any(b.lower() not in ("100%", "all", "full", "none") for b in budgets):
        raise ConfigError(
            f"--gpu-memory {gpu_memory} decides the expert budget from the memory split: "
            f"leave --expert-budget out (it was {expert_budget!r}), or drop --gpu-memory"
        )
    return budgets


def latency_llm_kwargs(text: str) -> dict[str, Any]:
    """--set for bench latency: each run's budget comes from --expert-budget / --gpu-memory, so
    --set naming either is refused (it would reach the 100% reference or the split run)."""
    from moetier.errors import ConfigError

    kwargs = parse_kv(text)
    for key in ("expert_budget", "gpu_memory"):
        if key in kwargs:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"bench latency sets each run's budget itself: give {flag} {kwargs[key]}, not "
                f"--set {key}={kwargs[key]} (--set applies to every run, the 100% reference "
                "included)"
            )
    return kwargs


def run_flags_from_set(args: argparse.Namespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Move the run's own LLM arguments out of the --set `kwargs` into `args` (in place) and
    return the rest; a flag given with another value than --set's is an error."""
    from moetier.errors import ConfigError

    rest = dict(kwargs)
    for key, default in _RUN_FLAGS.items():
        if key not in rest:
            continue
        value, given = rest.pop(key), getattr(args, key)
        if given != default and given != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} {given} and --set {key}={value} disagree: give one")
        setattr(args, key, value)
    return rest


def latency_settings(args: argparse.Namespace) -> Any:
    from moetier.bench.latency import LatencySettings

    set_kwargs = run_flags_from_set(args, latency_llm_kwargs(args.set))
    return LatencySettings(
        model=args.model,
        synthetic=args.synthetic,
        layers=args.layers,
        synthetic_format=args.format,
        budgets=latency_budgets(args.expert_budget, args.gpu_memory),
        gpu_memory=args.gpu_memory,
        host_budget=args.host_budget,
        batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=max(args.num_prompts, args.batch_size),
        seed=args.seed,
        weights_seed=args.weights_seed,
        warmup=args.warmup,
        routing=args.routing,
        device=args.device,
        dtype=args.dtype,
        policy=args.policy,
        compare=[c for c in args.compare.split(",") if c.strip()],
        profile_steps=args.profile_steps,
        accelerate_output_len=args.accelerate_output_len,
        save_trace=args.save_trace,
        llm_kwargs={
            **_with_kv_dtype(_with_prefetch(set_kwargs, args.prefetch), args.kv_cache_dtype),
            **parallel_kwargs(args),
        },
        progress=not args.no_progress,
    )


def bench_threads(requested: int | None, device: str) -> int | None:
    """Apply the bench's torch threads once, before anything runs: `requested`, or on a CPU
    device auto's count now (not per budget: a later budget would count the bench's own load);
    None (torch's choice) on CUDA unless requested."""
    from moetier.bench.latency import resolve_device
    from moetier.threads import configure_threads

    return configure_threads(requested, resolve_device(device))


def cmd_latency(args: argparse.Namespace) -> int:
    from moetier.bench.latency import run_latency
    from moetier.bench.report import latency_table, save_json

    settings = latency_settings(args)
    threads = bench_threads(args.threads, settings.device)
    if threads is not None:  # every budget's LLM and the baselines run on the same count
        settings.llm_kwargs.setdefault("threads", threads)
    save = args.save_result
    result = run_latency(settings, (lambda partial: save_json(save, partial)) if save else None)
    print(latency_table(result))
    if args.save_result:
        save_json(args.save_result, result)
        print(f"\nsaved {args.save_result}", file=sys.stderr)
    plot_dir = args.plot
    if plot_dir:
        from pathlib import Path

        _plot(result, plot_dir, Path(save).stem if save else "latency")
    return 0


def _plot(result: dict[str, Any], out_dir: str, stem: str) -> None:
    from moetier.bench.plots import write_plots

    try:
        paths = write_plots(result, out_dir, stem)
    except ImportError as exc:
        print(
            f"plots skipped: {exc} (run `moetier bench plot RESULT.json` elsewhere)",
            file=sys.stderr,
        )
        return
    except Exception as exc:  # a plot must never cost the measured numbers
        print(f"plots failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)


def cmd_synthetic(args: argparse.Namespace) -> int:
    import time

    from moetier.bench.synthetic import ensure_synthetic

    t0 = time.perf_counter()
    path = ensure_synthetic(args.shape, args.layers, args.seed, args.fill_device, args.format)
    print(path)
    print(f"ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    path = Path(args.result)
    result = json.loads(path.read_text())
    _plot(result, args.out_dir or str(path.parent), path.stem)
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from moetier.bench.gate import GateSettings, run_gate

    settings = GateSettings(
        baseline=parse_kv(args.baseline),
        candidate=parse_kv(args.candidate),
        name=args.name,
        shapes=[s for s in args.shapes.split(",") if s.strip()],
        layers=args.layers,
        seeds=[int(x) for x in args.seeds.split(",") if x.strip()],
        weights_seed=args.weights_seed,
        expert_budget=args.expert_budget,
        input_len=args.input_len,
        output_len=args.output_len,
        batch_size=args.batch_size,
        routing=args.routing,
        device=args.device,
        dtype=args.dtype,
        noise=args.noise,
        metric=args.metric,
        out_dir=args.out_dir,
        progress=not args.no_progress,
    )
    text, verdict = run_gate(settings)
    print(text)
    return 0 if verdict in ("SHIP", "NO-SHIP") else 1
