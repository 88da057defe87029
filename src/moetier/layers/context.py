"""The per-step forward context handed from the model runner to every layer.

Describes which flattened tokens belong to which sequence and where its KV lives; no tensors
are owned here beyond positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class KVStore(Protocol):
    """What attention needs from the KV cache: append this step's K/V, get the whole history."""

    def append(
        self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k [q, Hkv, Dk], v [q, Hkv, Dv]; return the sequence's k, v [L, Hkv, D*]."""
        ...


@dataclass(frozen=True)
class SeqSpan:
    """Tokens [start, end) of the flattened batch belong to `seq_id`, after `past` cached tokens."""

    seq_id: int
    start: int
    end: int
    past: int


@dataclass
class ForwardContext:
    """One step's batch layout: spans per sequence, token positions [T], and the KV store."""

    spans: list[SeqSpan]
    positions: torch.Tensor  # [T] int64
    kv: KVStore
    # Per-step memo for values every layer would otherwise recompute (rotary cos/sin tables),
    # keyed by whoever fills it; lives for one forward only.
    memo: dict[Any, Any] = field(default_factory=dict)
