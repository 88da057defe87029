"""Vocabulary types of the offload package: ExpertKey and the ExpertProvider interface.

Imports no engine, server or model code; the MoE layer talks to offload only through these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from moetier.offload.device_cache import DeviceCache


class ExpertKey(NamedTuple):
    """One routed expert of one MoE layer."""

    layer: int
    expert: int


@dataclass
class ExpertBatch:
    """Experts of one layer made ready on the compute stream, in the order they were asked for.

    `slots[i]` is the pool row holding `experts[i]`; per-expert weights are built only when
    asked for (`weights(i)`: the slot-reading kernel never needs them, and they cost host
    time; a compressed expert is decoded there).

    Late reads (CPU without a host tier): `late` maps the index of each expert whose disk read
    was still running when fetch returned to its slot; the caller computes the others first and
    calls `ready(i)` before it reads expert i's weights (`ready_all()` before reading them all
    at once). Everywhere else `late` is empty and `ready` does nothing.
    """

    layer: int
    experts: list[int]
    slots: list[int]
    # The packed slot pool [S, 3*I*D] the slots index.
    pool: torch.Tensor
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    late: dict[int, int] = field(default_factory=dict)
    waiter: Callable[[int], None] | None = None  # waits for one late slot; raises its error

    def ready(self, i: int) -> None:
        """Wait until experts[i]'s weights are in place (a no-op unless its read is late)."""
        slot = self.late.pop(i, None)
        if slot is not None:
            assert self.waiter is not None
            self.waiter(slot)

    def ready_all(self) -> None:
        for i in sorted(self.late):
            self.ready(i)

    def compute_order(self) -> list[int]:
        """Indices with the experts already in place first, then the late ones, ascending."""
        if not self.late:
            return list(range(len(self.experts)))
        return [i for i in range(len(self.experts)) if i not in self.late] + sorted(self.late)

    def weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """experts[i]'s (gate_up [2I, D], down [D, I]): views into the pool when dense, decoded
        copies when compressed (weights/formats.py). Call `ready(i)` first."""
        return self.split(self.pool[self.slots[i]])


class ExpertProvider(Protocol):
    """What an MoE layer needs: experts ready to compute with, wherever they live."""

    # True: give `fetch` the call's routing with its first wave (the slot policy learns from
    # it); False: pass None and build nothing.
    wants_routing: bool

    @property
    def max_batch(self) -> int:
        """Most experts of one layer that can be held ready at once (callers split into waves)."""
        ...

    @property
    def intermediate(self) -> int:
        """I, the routed experts' intermediate size."""
        ...

    @property
    def pool(self) -> torch.Tensor:
        """The packed slot pool [S, 3*I*D] that slot ids index."""
        ...

    @property
    def resident_table(self) -> torch.Tensor | None:
        """[layers, E] int32 slot of each expert on the compute device when every routed expert
        is resident for good (then no step needs a host decision); None otherwise."""
        ...

    @property
    def device_cache(self) -> DeviceCache | None:
        """The device-resident cache (offload/device_cache.py) when it resolves every layer
        call on the device; None: the host decides misses."""
        ...

    def count_resident(self, pairs: int, resident: bool = True) -> None:
        """Count one layer call: `pairs` (token, expert) lookups served by `resident_table`
        (`resident`) or by `device_cache`."""
        ...

    def count_routed(self, pairs: int, distinct: int) -> None:
        """Count one layer call routed on the host: `pairs` (token, expert) lookups asked for,
        `distinct` experts after the dedup across the step's batch."""
        ...

    def count_streamed(self, loads: int) -> None:
        """Count one layer call that streamed the next MoE layer's experts (`loads` started)."""
        ...

    def streaming(self, layer: int) -> None:
        """The next call of `layer` belongs to a streamed step (it touches at least the stream
        share of its experts, in one wave): the provider may evict in the step's order."""
        ...

    def count_routing_sync(self, seconds: float) -> None:
        """Count host time spent waiting for routing ids (the layer's host sync)."""
        ...

    def fetch(
        self, layer: int, experts: list[int], routing: Sequence[Sequence[int]] | None = None
    ) -> ExpertBatch:
        """Make `experts` (distinct, at most max_batch) of `layer` ready on the compute stream.
        `routing`: each token's top-k expert ids ([T][K], token order), with the first wave of
        a layer call only and only when `wants_routing`; later waves of the call pass None."""
        ...

    def release(self, batch: ExpertBatch) -> None:
        """Compute using `batch` has been issued; its slots may be reused after it completes."""
        ...

    def prefetch(self, layer: int, experts: Sequence[int], streamed: bool = False) -> int:
        """Start low-priority loads of `experts` of `layer` (a guess; never evicts what a wave
        being computed holds); returns how many loads started. Never blocks. `streamed`: the
        next layer of a streamed step (every expert of it will be used)."""
        ...
