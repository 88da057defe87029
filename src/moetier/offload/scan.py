"""Scan-aware eviction for wide steps: victims from the layers a step has already computed.

A long prompt (or a large batch) touches nearly every expert of every MoE layer, in layer
order, once per step. Under LRU such a scan evicts the keys of the layers it has not reached
yet (the least recent ones, resident since the last step) to make room for the current layer,
and so moves every expert of the step. The keys that will be needed last are those of the
layers the scan has just computed (their next use is in the next step, in layer order), so a
wide call takes its victims from them, the most recently computed layer first, before the
policy is asked (the policy's order still rules narrow calls and ties). Owns only the record of
which layers the current scan passed; the expert cache owns the slots.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ScanOrder:
    """Layers of the current scan, in the order its wide calls fetched them."""

    def __init__(self, min_experts: int = 0) -> None:
        self.min_experts = min_experts  # a call fetching at least this many is wide; 0 = off
        self.layers: list[int] = []

    def observe(self, layer: int, experts: int) -> None:
        """One layer call fetching `experts` distinct experts starts."""
        wide = self.min_experts > 0 and experts >= self.min_experts
        if not wide or (self.layers and layer <= self.layers[-1]):
            self.layers = []  # a narrow call, or a new step from a lower layer: no scan
        if wide:
            self.layers.append(layer)

    def victim(self, keys_of_layer: Any, exclude: Iterable[Any]) -> Any | None:
        """A key of the layer this scan computed most recently before the current one (then
        the one before...) that is not in `exclude`; None outside a scan or when none is."""
        skip = set(exclude)
        for layer in reversed(self.layers[:-1]):
            for key in sorted(keys_of_layer(layer)):
                if key not in skip:
                    return key
        return None
