"""Late reads of the device tier (CPU without a host tier, `late_reads`): a fetch returns while
its misses are still read on the read threads.

Owns nothing: functions over an `ExpertCache` (offload/expert_cache.py), like cancel.py. The
fetch hands the wave's reads to the threads (`go_late`); the batch's `ready(i)` waits for one
(`finish_late`, exposed fetch time); `settle_late` at release waits for the ones nobody waited
for and hands back the slots of failed reads. A late read's slot stays pinned until release,
so nothing else moves or cancels its load meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetier.offload.expert_cache import ExpertCache, _Wave
    from moetier.offload.types import ExpertBatch


def go_late(cache: ExpertCache, wave: _Wave) -> dict[int, int]:
    """Hand the wave's pending reads to the read threads and return {index in the wave: slot}
    of its slots still loading; {} when the wave's loads are to be finished now. With no expert
    in place to compute meanwhile, the first read stays queued, so the caller's wait runs it on
    its own thread (no hand-off)."""
    if not (cache.late_reads and wave.pending):
        return {}
    reads = [ld.read for ld in cache._loads_of(wave.pending) if ld.read is not None]
    hits = len(wave.slots) > len(wave.pending)
    cache.reads.start(reads if hits else reads[1:])
    pending = set(wave.pending)
    wave.pending.clear()
    return {i: slot for i, slot in enumerate(wave.slots) if slot in pending}


def finish_late(cache: ExpertCache, slot: int) -> None:
    """Wait for the late load of `slot` (its read, on this thread if not started); the wait is
    exposed fetch time. A failed read raises; its slot is handed back by `settle_late`."""
    load = cache.table.slots[slot].load
    if load is None:  # finished already
        return
    start = time.perf_counter()
    try:
        cache._advance_load(load, urgent=True)
    except Exception:
        cache._late_failed.append(load)
        raise
    finally:
        cache.stats.exposed_fetch_s += time.perf_counter() - start


def settle_late(cache: ExpertCache, batch: ExpertBatch) -> None:
    """At release: finish the batch's late reads the caller never waited for (it raised), then
    unpin the batch's slots and hand back those whose reads failed."""
    for i in sorted(batch.late):
        # a failed read is recorded in _late_failed; the caller's own error is on its way
        with contextlib.suppress(Exception):
            batch.ready(i)
    for s in batch.slots:
        cache.table.unpin(s)
    for load in cache._late_failed:
        cache._drop(load)
    cache._late_failed.clear()
