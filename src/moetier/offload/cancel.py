"""Cancelling prefetch loads of the device tier: a stale guess, a slot or host row a miss needs.

Owns nothing: functions over an `ExpertCache`'s loads (offload/expert_cache.py), which decides
when to cancel. A cancelled load's bytes already on their way either land before the slot's
next copy (same copy stream) or are waited out (a CPU read into the slot itself); a read into a
host row is left to finish, detached, and its row is handed back once it is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetier.offload.expert_cache import ExpertCache
    from moetier.offload.transfer import Load


def cancel(cache: ExpertCache, load: Load) -> None:
    """Stop an unpinned prefetch; the caller vacates its slot."""
    cache.stats.prefetches_cancelled += 1
    if load.read is not None:
        if cache.reads.cancel(load.read):
            load.read = None
        elif load.direct:  # running into the slot itself: wait it out (CPU, rare)
            try:
                cache.host.count_read(*cache.reads.wait(load.read))
                cache.stats.prefetch_wasted_bytes += cache.expert_bytes
            except Exception:
                pass
            load.read = None
        else:  # running into a host row: let it finish on its own, then give the row back
            load.slot = None
            cache._detached.append(load)
            return
        if load.row is not None:
            cache.host.unhold(load.row)
            cache.host.discard(load.row)
        return
    copy = load.copy
    assert copy is not None and load.slot is not None
    issued = cache.transfer.cancel(copy)
    cache.stats.prefetch_wasted_bytes += issued
    cache.stats.bytes_host_to_device += issued
    if not copy.issued and copy.after is not None:  # the slot's last use is still ahead
        cache.slot_free_event.setdefault(load.slot, copy.after)
    if load.row is not None:
        if copy.issued:
            cache.host.mark_in_flight(load.row, copy.event)
        cache.host.unhold(load.row)


def cancel_where(cache: ExpertCache, which: Callable[[Load], bool]) -> None:
    """Cancel every unpinned load in progress that `which` selects and free its slot."""
    for slot in cache.table.loading_slots():
        s = cache.table.slots[slot]
        if not s.pins and which(s.load):
            cancel(cache, s.load)
            cache.policy.remove(cache.table.vacate(slot))
            cache.table.give_back(slot)


def reap_detached(cache: ExpertCache) -> None:
    """Hand back the host rows of cancelled loads whose reads have finished."""
    keep = []
    for load in cache._detached:
        assert load.read is not None and load.row is not None
        if not load.read.done:
            keep.append(load)
            continue
        with contextlib.suppress(Exception):  # a failed read of an abandoned prefetch
            cache.host.count_read(*cache.reads.wait(load.read))
        cache.host.unhold(load.row)
        cache.host.discard(load.row)
    cache._detached = keep
