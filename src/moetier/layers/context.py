"""The per-step forward context handed from the model runner to every layer.

Describes which flattened tokens belong to which sequence and where its KV lives (slots of the
paged KV cache); no tensors are owned here beyond positions and KV addressing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class KVStore(Protocol):
    """What attention needs from the KV cache: write this step's K/V, read a history back."""

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor
    ) -> None:
        """Store k [T, Hkv, dk], v [T, Hkv, dv] (None: keys only) at flat slots [T]."""
        ...

    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V at slots [...] -> [..., Hkv, d*] in `dtype` (dequantized when the store
        quantizes); V None when only keys are stored."""
        ...

    def exact(self, dtype: torch.dtype) -> bool:
        """Whether a read in `dtype` gives back exactly what was written in `dtype` (no
        quantization or narrower storage)."""
        ...


@dataclass
class KVBatch:
    """One step's KV addressing, built once by the runner and read by every attention layer.

    slot_mapping [T]: the flat slot each new token's K/V goes to. Decode rows (one query token
    per sequence) are attended together: `decode_rows` [B] index the flattened batch,
    `decode_slots` [B, L] the history slots (padded with slot 0), `decode_mask` [B, 1, 1, L]
    which of them are real. Other spans (prefill chunks) use `span_slots[i]` [L_i] each.

    Hybrid models (recurrent-state layers, layers/gated_deltanet.py): `state_slots[i]` is span
    i's slot in the state pools (engine/state_cache.py) and `decode_state_slots` [B] those of
    the decode rows, in `decode_rows` order; empty / None for models without such layers.
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_spans: tuple[int, ...] = ()  # indexes into ctx.spans
    span_slots: dict[int, torch.Tensor] | None = None
    state_slots: tuple[int, ...] = ()
    decode_state_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class SeqSpan:
    """Tokens [start, end) of the flattened batch belong to `seq_id`, after `past` cached tokens."""

    seq_id: int
    start: int
    end: int
    past: int


@dataclass
class ForwardContext:
    """One step's batch layout: spans per sequence, positions [T], the KV store and addressing."""

    spans: list[SeqSpan]
    positions: torch.Tensor  # [T] int64
    kv: KVStore
    kv_batch: KVBatch
    # The recurrent-state pools of hybrid models (a StateStore, layers/gated_deltanet.py);
    # None for models whose every layer attends through the KV cache.
    states: Any = None
    # Per-step memo for values every layer would otherwise recompute (rotary cos/sin tables),
    # keyed by whoever fills it; lives for one forward only.
    memo: dict[Any, Any] = field(default_factory=dict)
