"""Per-sequence recurrent state of hybrid models (Gated DeltaNet layers, Qwen3-Next, Qwen3.5):
a fixed pool of state slots allocated at start-up, one per sequence that may run at once.

`StateSlots` is the bookkeeping (pure Python, held by the scheduler like the block manager):
a request gets a slot when admitted and gives it back when it finishes, aborts, fails or is
preempted (it then recomputes from token 0, as its K/V). `RecurrentStateCache` owns the pool
tensors per linear-attention layer: conv states [slots, C, K-1] in the model dtype and
recurrent states [slots, Hv, dk, dv] in float32; it zeroes a sequence's states before the step
that computes its first token and builds the step's slot indexes for `KVBatch`.

The full-attention layers of these models use the paged KV cache as every other family. Prefix
caching is off for them: a cached K/V prefix is of no use without the states at its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moetier.config import format_bytes
from moetier.device_memory import allocate
from moetier.layers.context import KVBatch

log = logging.getLogger(__name__)


class StateSlots:
    """Slot ids 0 .. n-1, one per running sequence; lowest free id first (tests assert ids)."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() -> lowest
        self.slot_of: dict[int, int] = {}  # seq id -> slot

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def assign(self, seq_id: int) -> int:
        """The sequence's slot, taking a free one if it holds none."""
        slot = self.slot_of.get(seq_id)
        if slot is None:
            if not self.free_slots:
                raise MemoryError(
                    f"recurrent state: no free slot for sequence {seq_id} (all {self.num_slots} "
                    "held; the pool has one per --max-num-seqs)"
                )
            slot = self.slot_of[seq_id] = self.free_slots.pop()
        return slot

    def free(self, seq_id: int) -> bool:
        """Give the sequence's slot back; False when it held none."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return False
        self.free_slots.append(slot)
        return True

    def check_integrity(self) -> None:
        held = list(self.slot_of.values())
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert not set(held) & set(self.free_slots), "a held state slot is free"
        assert len(held) + len(self.free_slots) == self.num_slots, "state slots leaked"


@dataclass(frozen=True)
class LayerState:
    """One linear-attention layer's per-sequence state shapes."""

    conv: tuple[int, int]  # [C, K-1]
    recurrent: tuple[int, int, int]  # [Hv, dk, dv]


def state_layout(model: torch.nn.Module) -> dict[int, LayerState]:
    """Layer -> the state shapes of its Gated DeltaNet module; empty for non-hybrid models."""
    from moetier.layers.gated_deltanet import GatedDeltaNet

    out: dict[int, LayerState] = {}
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            assert m.layer not in out, f"two state modules for layer {m.layer}"
            out[m.layer] = LayerState(m.conv_state_shape, m.recurrent_state_shape)
    return out


RECURRENT_DTYPE = torch.float32


def state_bytes_per_slot(layout: dict[int, LayerState], dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for spec in layout.values():
        c, w = spec.conv
        h, dk, dv = spec.recurrent
        total += c * w * size + h * dk * dv * RECURRENT_DTYPE.itemsize
    return total


class RecurrentStateCache:
    """The state pools of every linear-attention layer, indexed by `StateSlots` ids."""

    def __init__(
        self,
        layout: dict[int, LayerState],
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.layout = layout
        self.slots = StateSlots(num_slots)
        self.device = device
        self._conv = {
            layer: torch.zeros(num_slots, *s.conv, dtype=dtype, device=device)
            for layer, s in layout.items()
        }
        self._recurrent = {
            layer: torch.zeros(num_slots, *s.recurrent, dtype=RECURRENT_DTYPE, device=device)
            for layer, s in layout.items()
        }

    def conv(self, layer: int) -> torch.Tensor:
        return self._conv[layer]

    def recurrent(self, layer: int) -> torch.Tensor:
        return self._recurrent[layer]

    def bytes(self) -> int:
        pools = (*self._conv.values(), *self._recurrent.values())
        return sum(t.numel() * t.element_size() for t in pools)

    def prepare(self, spans: list[tuple[int, int, int]], kv_batch: KVBatch) -> None:
        """spans: (seq_id, past, num_new) in the step's order. Assigns slots to sequences that
        hold none (a forward outside the scheduler, e.g. `LLM.prompt_logits`), zeroes the
        states of sequences starting at token 0 and sets the step's slot indexes."""
        slots = tuple(self.slots.assign(seq) for seq, _, _ in spans)
        self.zero([slot for slot, (_, past, _) in zip(slots, spans) if past == 0])
        kv_batch.state_slots = slots
        if kv_batch.decode_spans:
            decode = [slots[i] for i in kv_batch.decode_spans]
            kv_batch.decode_state_slots = torch.tensor(decode, dtype=torch.long).to(
                self.device, non_blocking=True
            )

    def free(self, seq_id: int) -> bool:
        return self.slots.free(seq_id)

    def _pools(self) -> tuple[torch.Tensor, ...]:
        return (*self._conv.values(), *self._recurrent.values())

    def zero(self, slots: list[int]) -> None:
        """Zero every layer's states of these slots (sequences starting at token 0)."""
        if slots:
            index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
            for pool in self._pools():
                pool.index_fill_(0, index, 0)

    def save(self, slots: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A copy of every layer's states of `slots` [B] (int64, on the device), for `restore`:
        a CUDA graph capture's warm-up forward advances them once more than the step does."""
        return slots.clone(), [pool[slots] for pool in self._pools()]

    def restore(self, saved: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        slots, copies = saved
        for pool, copy in zip(self._pools(), copies):
            pool.index_copy_(0, slots, copy)


def build_state_cache(
    model: torch.nn.Module, max_num_seqs: int, device: torch.device, dtype: torch.dtype
) -> RecurrentStateCache | None:
    """The pools for `max_num_seqs` sequences, allocated now; None for non-hybrid models."""
    layout = state_layout(model)
    if not layout:
        return None
    per_slot = state_bytes_per_slot(layout, dtype)
    what = (
        f"the recurrent state pools ({max_num_seqs} slots x {len(layout)} linear-attention "
        f"layers, {format_bytes(per_slot)} per slot)"
    )
    cache = allocate(
        device,
        lambda: RecurrentStateCache(layout, max_num_seqs, device, dtype),
        what,
        lambda: per_slot * max_num_seqs,
        lambda _: "Lower --max-num-seqs: the pools hold one slot per sequence that may run.",
    )
    log.info("%s: %s allocated", what, format_bytes(cache.bytes()))
    return cache
