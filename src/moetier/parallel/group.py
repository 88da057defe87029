"""This process's place in an expert-parallel group: its rank, the placement, the collectives.

One MoE layer on N ranks: each rank computes the (token, k) terms of the experts it owns
(each term already weighted and rounded to the model dtype, as one device computes it) into a
zeroed [T, K, D] buffer; one all-reduce over the buffer's bits (every element has exactly one
rank that wrote it, the others hold zero bits, so the integer sum is that rank's bits, with no
rounding) gives every rank every term; each rank then adds each token's terms in ascending
expert order (or sums its K terms at once, for `topk_sum` families), the same adds as one
device, so greedy tokens equal the one-rank run and transformers.

Rank 0 drives: it broadcasts each step's plan (`StepPlan`), a stats request or the stop, and
the other ranks follow (`parallel/worker.py`). A collective that fails or times out (a rank
died or hangs) marks the group broken: the step's requests fail with the reason, and every
later step fails at once with it (the server answers 503).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetier.errors import MoetierError
from moetier.parallel.placement import Placement

log = logging.getLogger(__name__)


class ExpertParallelError(MoetierError):
    """A rank of the expert-parallel group failed, hung or disagrees with rank 0."""


@dataclass
class StepPlan:
    """What every rank needs to run one engine step as rank 0 does: per sequence its id, how
    many tokens precede the chunk, the chunk's token ids and its block table (through the
    chunk); the hybrid state slot of each sequence; which sequences sample; the requests that
    ended since the last step (the slot policies learn from them)."""

    spans: list[tuple[int, int, list[int]]]
    tables: dict[int, list[int]]
    samples: list[bool]
    state_slots: dict[int, int] = field(default_factory=dict)
    ended: list[int] = field(default_factory=list)


@dataclass
class CollectiveStats:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0
    steps: int = 0

    def to_dict(self) -> dict[str, float]:
        return {
            "collective_calls": self.calls,
            "collective_s": self.seconds,
            "collective_bytes": self.bytes,
            "parallel_steps": self.steps,
        }


def checkpoint_fingerprint(model: str) -> str:
    """config.json's bytes and every weight file's name and size: ranks given different
    checkpoints disagree here (start-up error), without reading the weights."""
    path = Path(model)
    h = hashlib.sha256()
    root = path if path.is_dir() else path.parent
    files = sorted(root.glob("*.safetensors")) + sorted(root.glob("*.gguf"))
    if path.is_file():
        files = [path]
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:16]


class ExpertParallel:
    """The joined group (torch.distributed's default group) as one MoE layer and the engine
    use it."""

    def __init__(self, placement: Placement, timeout_s: float) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.placement = placement
        self.timeout_s = timeout_s
        self.stats = CollectiveStats()
        self.broken: str | None = None  # why the group is unusable, once it is
        self.ended: list[int] = []  # rank 0: requests ended since the last step

    def owns(self, layer: int, expert: int) -> bool:
        return self.placement.owns(self.rank, layer, expert)

    # the MoE layer's collective
    def exchange(self, terms: torch.Tensor) -> torch.Tensor:
        """Every rank's terms [T, K, D] (zero where another rank owns the expert) -> all of
        them, bit for bit, on every rank."""
        flat = terms.view(-1)
        nbytes = flat.numel() * flat.element_size()
        bits = flat.view(torch.int32) if nbytes % 4 == 0 else flat.view(torch.uint8)
        t0 = time.perf_counter()
        self._collective(dist.all_reduce, bits, op=dist.ReduceOp.SUM)
        self.stats.calls += 1
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - t0
        return terms

    # rank 0 drives, the others follow
    def send(self, message: tuple[Any, ...]) -> None:
        """Rank 0: a message to every other rank ("step", plan), ("stats",) or ("stop",)."""
        assert self.rank == 0
        if self.broken is not None:
            raise ExpertParallelError(self.broken)
        self._collective(dist.broadcast_object_list, [message], src=0)

    def receive(self) -> tuple[Any, ...]:
        box: list[Any] = [None]
        self._collective(dist.broadcast_object_list, box, src=0)
        message: tuple[Any, ...] = box[0]
        return message

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None on the others)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0)
        return out

    def send_step(self, plan: StepPlan) -> None:
        plan.ended, self.ended = self.ended, []
        self.send(("step", plan))
        self.stats.steps += 1

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self.broken is not None:
            raise ExpertParallelError(self.broken)
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # a peer closed its connection, or the timeout passed
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.broken = (
                f"expert-parallel group of {self.world} ranks failed on rank {self.rank}: a rank "
                f"stopped or did not answer within {self.timeout_s:g} s ({first}); restart "
                "moetier"
            )
            log.error("%s", self.broken)
            raise ExpertParallelError(self.broken) from exc

    def close(self) -> None:
        """Rank 0: tell the other ranks to exit (nothing when the group is broken)."""
        if self.rank == 0 and self.broken is None and dist.is_initialized():
            with contextlib.suppress(ExpertParallelError):
                self.send(("stop",))
        self.broken = self.broken or "the expert-parallel group was closed"


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another env:// launcher) started it, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "MOETIER_EP_RANK" in os.environ:
        return int(os.environ.get("RANK", os.environ.get("MOETIER_EP_RANK", "0")))
    return None
