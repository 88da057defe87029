"""Orders among finished and ahead layers for streamed steps, replayed (CPU, no tensors): the
shipped `StepAwarePolicy` (finished layers, the latest first; then ahead, the farthest first)
against finished-earliest-first and ahead-before-finished, always on (`step-lru` form) or as
the `stream_eviction` wrapper around LRU (decode steps on LRU). Prints each prompt's prefill
loads, their warm mean and the run's total loads. Usage, from the repository root:

    HF_HUB_OFFLINE=1 PYTHONPATH=src python scripts/step_aware_variants.py \
        ROUTING BUDGET PROMPTS OUTPUT_LEN [always|wrapper]

ROUTING: uniform:128x8 or a trace file (as `moetier replay --prompt-len`); 48 layers, 2,048
tokens a prompt, stream share 0.9. Results: bench/results/2026-12-06-step-aware-eviction.md.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Iterator

import moetier.bench.replay as rp
import moetier.bench.stream_replay as sr
from moetier.offload.policy import LRUPolicy, Policy
from moetier.offload.step_aware import StepAwarePolicy, StreamEviction


class EarliestFirst(StepAwarePolicy):
    """Finished layers, the earliest first; then ahead, the farthest first; the current last."""

    def _victim_layers(self) -> Iterator[int]:
        layers = self._layers
        cut = len(layers) if self._layer is None else bisect_left(layers, self._layer)
        yield from layers[:cut]
        yield from reversed(layers[cut:])


class AheadFirst(StepAwarePolicy):
    """Ahead, the farthest first; then finished, the latest first; the current last."""

    def _victim_layers(self) -> Iterator[int]:
        layers = self._layers
        cut = len(layers) if self._layer is None else bisect_left(layers, self._layer)
        yield from (la for la in reversed(layers[cut:]) if la != self._layer)
        yield from reversed(layers[:cut])
        if self._layer in layers:
            yield self._layer


VARIANTS = {
    "finished latest first (shipped)": StepAwarePolicy,
    "finished earliest first": EarliestFirst,
    "ahead before finished": AheadFirst,
}


def main() -> None:
    spec, budget, prompts, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    form = sys.argv[5] if len(sys.argv) > 5 else "always"
    trace, label = sr.routing_trace(spec, 48, prompts, 2048, 0, out)
    pre = sr._prefill_steps(trace.records)
    slots = rp.slots_for_budget(trace.header, budget)
    for name, cls in VARIANTS.items():
        policy: Policy
        if form == "always":
            policy, eviction = cls(LRUPolicy(), always=True), False
        else:

            class Switch(StreamEviction):
                def __init__(self, base: Policy, cls: type[StepAwarePolicy] = cls) -> None:
                    super().__init__(base)
                    self.step_aware = cls(base)

            rp.StreamEviction = Switch  # type: ignore[misc]
            policy, eviction = LRUPolicy(), True
        run = rp.Streaming(0.9, trace.header.num_experts, trace.header.moe_layers, eviction)
        r = rp.simulate(trace.records, slots, policy, streaming=run)
        per = [r.step_loads[s] for s in pre]
        warm = sum(per[1:]) / max(len(per) - 1, 1)
        print(
            f"{label}, {budget}, {prompts} prompts + {out} decode steps, {form}: {name:<32} "
            f"prefill {per} warm {warm:.1f} total {sum(r.step_loads.values())}"
        )


if __name__ == "__main__":
    main()
