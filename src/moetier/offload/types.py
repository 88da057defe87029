"""Vocabulary types of the offload package: ExpertKey and the ExpertProvider interface.

Imports no engine, server or model code; the MoE layer talks to offload only through these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class ExpertKey(NamedTuple):
    """One routed expert of one MoE layer."""

    layer: int
    expert: int


@dataclass
class ExpertBatch:
    """Experts of one layer made ready on the compute stream, in the order they were asked for."""

    layer: int
    experts: list[int]
    gate_up: list[torch.Tensor]  # each [2I, D]
    down: list[torch.Tensor]  # each [D, I]
    slots: list[int]
    # The packed slot pool [S, 3*I*D] the views point into, for kernels that gather by slot id
    # (None when the provider has no single pool).
    pool: torch.Tensor | None = None


class ExpertProvider(Protocol):
    """What an MoE layer needs: experts ready to compute with, wherever they live."""

    @property
    def max_batch(self) -> int:
        """Most experts of one layer that can be held ready at once (callers split into waves)."""
        ...

    def fetch(self, layer: int, experts: list[int]) -> ExpertBatch:
        """Make `experts` (distinct, at most max_batch) of `layer` ready on the compute stream."""
        ...

    def release(self, batch: ExpertBatch) -> None:
        """Compute using `batch` has been issued; its slots may be reused after it completes."""
        ...
