"""The expert-parallel flags of `serve`, `generate` and `bench latency`."""

from __future__ import annotations

import argparse
from typing import Any

from moetier.parallel.placement import PLACEMENTS

EXPERT_PARALLEL_HELP = (
    "spread the routed experts over N ranks, one process each (rank 0 starts the others on "
    "this host, or joins the ones torchrun started); each rank's --expert-budget and "
    "--host-budget are its own (a share: of its own experts); see docs/scaling.md (default: 1)"
)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expert-parallel-size", type=_positive, default=1, metavar="N", help=EXPERT_PARALLEL_HELP
    )
    p.add_argument(
        "--expert-placement",
        choices=PLACEMENTS,
        default="round-robin",
        help="which rank owns each expert: round-robin (expert e on rank e %% N) or balanced "
        "(by use in --placement-trace)",
    )
    p.add_argument(
        "--placement-trace",
        default=None,
        metavar="FILE",
        help="a moetier-trace file (moetier record-trace) for --expert-placement balanced",
    )


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM keyword arguments of the flags (only those that differ from the defaults)."""
    out: dict[str, Any] = {}
    if args.expert_parallel_size != 1:
        out["expert_parallel_size"] = args.expert_parallel_size
    if args.expert_placement != "round-robin":
        out["expert_placement"] = args.expert_placement
    if args.placement_trace is not None:
        out["placement_trace"] = args.placement_trace
    return out
