"""Command line of the demo and its traces: `moetier build-demo | record-trace | replay`.

Parsing and printing only: building lives in `builder.py`, tracing in `tracing.py`, replay in
`moetier.bench.replay`. `moetier.cli` registers these with one call to `add_demo_parsers`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from moetier.config import format_bytes


def add_demo_parsers(sub: Any) -> None:
    """Add build-demo, record-trace and replay to an argparse subparsers object."""
    demo = sub.add_parser(
        "build-demo",
        help="build (once) and print the demo model's directory, or a variant's",
        description="Build the SmolLM2-based demo MoE (default 16 experts, top-2) or a variant "
        "into $MOETIER_HOME/demo/<name>/ and print its directory.",
    )
    _add_variant_args(demo, experts=16, top_k=2)
    demo.add_argument(
        "--perturb",
        type=float,
        default=0.0,
        help="each expert = the dense FFN plus seeded noise of this relative RMS (e.g. 0.01); "
        "default 0: identical copies",
    )
    demo.set_defaults(func=cmd_build_demo)

    rec = sub.add_parser(
        "record-trace",
        help="record a real-text routing trace of an unperturbed demo variant (no build needed)",
        description="Greedy-answer chat prompts with the dense SmolLM2 and route each layer's "
        "MoE input through the variant's fit routers; writes a moetier-trace (JSON Lines, "
        "gzip when FILE ends with .gz).",
    )
    _add_variant_args(rec, experts=128, top_k=8)
    rec.add_argument("--out", required=True, help="trace file to write (.jsonl or .jsonl.gz)")
    rec.add_argument(
        "--prompts-file", default=None, help="one prompt per line (default: the shipped set)"
    )
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument(
        "--predictions",
        action="store_true",
        help="also record each call's next-MoE-layer gate lookahead (the next layer's router on "
        "this layer's MoE input, top-k) as `predicted` rows: a version 2 trace, replayable by "
        "`bench latency --prefetch trace` and `replay --predictor trace`",
    )
    rec.set_defaults(func=cmd_record_trace)

    rp = sub.add_parser(
        "replay",
        help="hit rates of expert-cache policies and Belady's optimum on a routing trace",
        description="Simulate each policy with the engine's slot semantics (one global pool of "
        "slots over all MoE layers) on a moetier-trace file and print hit rates beside Belady's.",
    )
    rp.add_argument("trace", metavar="FILE", help="moetier-trace file (.jsonl or .jsonl.gz)")
    rp.add_argument(
        "--policy",
        default="lru,lfu",
        help="comma-separated policies (lru, lfu, lfru, least-stale, layer-lru, activation, "
        "step-lru)",
    )
    rp.add_argument(
        "--predictor",
        default="",
        help="comma-separated next-layer predictors to score (same-index, last-call, "
        "activation; trace: the predictions recorded in a version 2 FILE): precision, recall, "
        "and each policy's hit rate with them prefetched",
    )
    rp.add_argument(
        "--expert-budget",
        default="25%",
        help="device slots: a share of all experts ('25%%') or bytes ('2GiB'); default 25%%",
    )
    rp.add_argument(
        "--json",
        action="store_true",
        help='print {"belady": h, "policies": {..}} (plus "predictors": {..} with --predictor)',
    )
    rp.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        metavar="N",
        help="streamed prefill steps instead of the trace's own steps: each step is one prompt "
        "of N tokens through every layer, routed from FILE as `bench latency --routing "
        "trace:FILE` does (FILE may be uniform:EXK, e.g. uniform:128x8); prints slot loads per "
        "step of each policy with and without stream_eviction, beside Belady",
    )
    rp.add_argument("--layers", type=int, default=None, help="--prompt-len: MoE layers")
    rp.add_argument(
        "--steps", type=int, default=4, help="--prompt-len: prompts, one after the other (4)"
    )
    rp.add_argument(
        "--output-len",
        type=int,
        default=0,
        help="--prompt-len: one-token decode steps after each prompt's prefill (default 0)",
    )
    rp.add_argument(
        "--stream-share",
        type=float,
        default=0.9,
        help="--prompt-len: a call touching this share of its layer's experts streams the next "
        "layer (moe_stream_share; default 0.9, CUDA's)",
    )
    rp.add_argument("--seed", type=int, default=0, help="--prompt-len with uniform: the draws")
    rp.set_defaults(func=cmd_replay)


def _add_variant_args(p: argparse.ArgumentParser, experts: int, top_k: int) -> None:
    p.add_argument("--experts", type=int, default=experts, help=f"experts per layer ({experts})")
    p.add_argument("--top-k", type=int, default=top_k, help=f"experts per token ({top_k})")
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the router fit and the experts' noise (0)"
    )


def cmd_build_demo(args: argparse.Namespace) -> int:
    from moetier.demo.builder import demo_model_dir, ensure_demo_model, is_complete
    from moetier.demo.variants import DemoSpec

    spec = DemoSpec(args.experts, args.top_k, args.perturb, args.seed)
    path = demo_model_dir(None, spec)
    if not is_complete(path):
        print(
            f"building {spec.name}: {spec.checkpoint_bytes / 1e9:.1f} GB "
            f"({format_bytes(spec.checkpoint_bytes)}) on disk (bfloat16, "
            f"30 layers x {spec.num_experts} experts of {format_bytes(spec.expert_bytes)}) "
            f"into {path}",
            file=sys.stderr,
        )
    print(ensure_demo_model(spec=spec))
    return 0


def cmd_record_trace(args: argparse.Namespace) -> int:
    from moetier.demo.tracing import record_variant_trace, save_trace, trace_stats
    from moetier.demo.variants import DemoSpec

    spec = DemoSpec(args.experts, args.top_k, 0.0, args.seed)
    prompts = None
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    trace = record_variant_trace(spec, prompts, args.max_new_tokens, predictions=args.predictions)
    out = save_trace(trace, args.out)
    stats = trace_stats(trace)
    s = stats.summary
    decode_reuse = sum(stats.decode_reuse) / len(stats.decode_reuse)
    print(
        f"[moetier] {spec.name}: {stats.prompts} prompts, {stats.prefill_tokens} prefill + "
        f"{stats.decode_tokens} decode tokens, {stats.lines} lines | consecutive-token reuse "
        f"{s.mean_reuse:.3f} (decode only {decode_reuse:.3f}) vs random {s.random_reuse:.3f}",
        file=sys.stderr,
    )
    print(out)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from moetier.bench import replay as rp

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    predictors = [p.strip() for p in args.predictor.split(",") if p.strip()]
    if args.prompt_len is not None:
        return _replay_streamed(args, policies)
    trace = rp.load_trace(args.trace)
    slots, best, rates = rp.replay(trace, args.expert_budget, policies)
    reports = rp.replay_predictors(trace, args.expert_budget, predictors, policies)
    if args.json:
        out: dict[str, object] = {"belady": best, "policies": rates}
        if reports:
            out["predictors"] = rp.predictors_json(reports)
        print(json.dumps(out))
        return 0
    print(rp.format_replay(args.trace, trace, args.expert_budget, slots, best, rates))
    if reports:
        print(rp.format_predictors(reports, best, rates))
    return 0


def _replay_streamed(args: argparse.Namespace, policies: list[str]) -> int:
    from moetier.bench import stream_replay as rp
    from moetier.errors import ConfigError

    if args.prompt_len < 1 or args.steps < 1 or (args.layers is not None and args.layers < 1):
        raise ConfigError("--prompt-len, --steps and --layers must be at least 1")
    if args.output_len < 0:
        raise ConfigError("--output-len must not be negative")
    trace, label = rp.routing_trace(
        args.trace, args.layers, args.steps, args.prompt_len, args.seed, args.output_len
    )
    result = rp.replay_streamed(trace, args.expert_budget, policies, args.stream_share)
    if args.json:
        print(json.dumps(rp.streamed_json(result)))
        return 0
    print(rp.format_streamed(label, trace, args.expert_budget, args.stream_share, result))
    return 0
