"""Device tier: a fixed pool of expert slots, filled on demand or ahead of need from the host tier.

Owns the slot tensors, the slot table (states and pins, `slots.py`), the slot policy and the
loads in progress; implements ExpertProvider. Never reads files itself (the host tier does, on
the transfer engine's read threads), never decides what to compute or what to prefetch.

A load brings one expert into one slot: a disk read (into a host row, or straight into a CPU
slot when there is no host tier), then a host->slot copy. On-demand loads (a fetch's misses)
are finished before fetch returns: their reads run in parallel on the read pool, each copy is
issued as soon as its read is done, and the compute stream waits on the copies' events. On a
CPU without a host tier (reads go straight into slots) a fetch with `late_reads` returns while
its misses are still read on the read threads; the batch's `ready(i)` waits for one, and
`release` settles whatever is left (offload/late_reads.py).
Prefetch loads run at low priority and are moved on whenever the cache is called (never
blocking); a fetch that needs one promotes it and waits on its event like a miss's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.offload.cancel import cancel, cancel_where, reap_detached
from moetier.offload.device_cache import DeviceCache
from moetier.offload.late_reads import finish_late, go_late, settle_late
from moetier.offload.policy import make_policy
from moetier.offload.slots import SlotState, SlotTable
from moetier.offload.stats import OffloadStats
from moetier.offload.step_aware import StreamEviction
from moetier.offload.store import HostTier
from moetier.offload.transfer import (
    DEFAULT_CHUNK_BYTES,
    ON_DEMAND,
    PREFETCH,
    Copier,
    CudaCopier,
    Load,
    ReadPool,
    SyncCopier,
    TransferEngine,
)
from moetier.offload.types import ExpertBatch, ExpertKey

log = logging.getLogger(__name__)


@dataclass
class _Wave:
    """Bookkeeping of one fetch."""

    exclude: set[ExpertKey]  # never victims: the wave's keys and every pinned key
    slots: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # slots whose loads this fetch finishes
    failed: list[Load] = field(default_factory=list)
    error: BaseException | None = None
    waits: bool = False  # something had to be loaded or waited for
    start_event: Any = None  # CUDA: compute-stream mark before the first load or wait


class ExpertCache:
    """`num_slots` device slots of packed experts; misses are fetched on demand (LRU by default),
    predicted experts can be prefetched at low priority."""

    def __init__(
        self,
        host: HostTier,
        num_slots: int,
        device: torch.device,
        stats: OffloadStats,
        policy: str = "lru",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = 1,
        io_threads: int = 2,
        copier: Copier | None = None,
        late_reads: bool = False,
        stream_eviction: bool = False,
        stream_copy_now: bool = False,
    ) -> None:
        """`copier` replaces the device's (tests: a fake with events completed by hand; it is
        pumped on every cache call, `window` prefetch chunks in flight). `stream_eviction`: the
        calls of streamed steps (announced by `streaming`) pick victims in the step's next-use
        order (offload/step_aware.py); every other call uses `policy` alone, as without it.
        `stream_copy_now`: a streamed step's prefetch of the next layer puts its copies on the
        stream at once, whole, instead of through the pump (see `prefetch`)."""
        self.host = host
        self.packing = host.packing  # slots hold experts as the host rows do (formats.py)
        self.shape = self.packing.shape
        self.device = device
        self.stats = stats
        self.num_slots = num_slots
        self.slots = torch.empty(
            num_slots, self.packing.numel, dtype=self.packing.storage_dtype, device=device
        )
        self._slot_rows = self.slots.unbind(0)  # one view per slot, made once (miss path)
        self.expert_bytes = self.packing.nbytes
        self.table = SlotTable(num_slots)
        self.policy = make_policy(policy)  # swapped for the step-aware wrapper while streaming
        self.wants_routing = self.policy.wants_routing
        self._stream = StreamEviction(self.policy) if stream_eviction else None
        self.stream_copy_now = stream_copy_now
        # Request id of each token of the current step ([T]), for the policy with a call's
        # routing; set by the model runner before each forward (only when `wants_routing`).
        self.token_requests: list[int] | None = None
        self.cuda = device.type == "cuda"
        if copier is not None:
            self.transfer = TransferEngine(copier, chunk_bytes, window=window)
        else:  # CPU copies are memcpys done on issue: no window, no pump thread
            own: Copier = CudaCopier(device) if self.cuda else SyncCopier()
            self.transfer = TransferEngine(
                own, chunk_bytes, window=window if self.cuda else None, background=self.cuda
            )
        self.reads = ReadPool(io_threads)
        # CPU, no host tier: fetch may return before its misses' reads finish (module doc).
        self.late_reads = late_reads and not self.cuda and not host.capacity
        self._late_failed: list[Load] = []  # late loads whose read failed, dropped at release
        self.slot_free_event: dict[int, Any] = {}  # last compute use of a slot (CUDA)
        self._detached: list[Load] = []
        self._last_layer: int | None = None
        self._resident_table: torch.Tensor | None = None
        # Set by the builder when residency and misses are resolved on the device: then this
        # object's own slot table stays empty and only the pool, host tier and stats are used.
        self.device_cache: DeviceCache | None = None

    @property
    def intermediate(self) -> int:
        return self.shape.intermediate

    @property
    def pool(self) -> torch.Tensor:
        return self.slots

    @property
    def slot_of(self) -> dict[ExpertKey, int]:
        return self.table.slot_of

    @property
    def resident_table(self) -> torch.Tensor | None:
        return self._resident_table

    def count_resident(self, pairs: int, resident: bool = True) -> None:
        self.stats.count_device_calls(pairs, resident=resident)

    def count_routed(self, pairs: int, distinct: int) -> None:
        self.stats.count_host_call(pairs, distinct)

    def count_streamed(self, loads: int) -> None:
        self.stats.streamed_calls += 1
        self.stats.prefetches_streamed += loads

    def count_routing_sync(self, seconds: float) -> None:
        self.stats.routing_sync_s += seconds

    def freeze_resident(self, num_layers: int, num_experts: int) -> None:
        """Every routed expert holds a slot and nothing will be evicted: publish the [layer,
        expert] -> slot map on the device so MoE layers can look slots up without the host."""
        assert len(self.slot_of) == self.num_slots, "freeze_resident needs every expert loaded"
        assert not self.table.loading_slots(), "freeze_resident needs every load finished"
        table = torch.full((num_layers, num_experts), -1, dtype=torch.int32)
        for key, slot in self.slot_of.items():
            table[key.layer, key.expert] = slot
        self._resident_table = table.to(self.device)

    @property
    def max_batch(self) -> int:
        return self.num_slots

    @property
    def bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """While held, no background thread makes a CUDA call (prefetch copies wait): wrap a
        CUDA-graph capture in it."""
        return self.transfer.paused()

    # the provider interface
    def fetch(
        self, layer: int, experts: list[int], routing: Sequence[Sequence[int]] | None = None
    ) -> ExpertBatch:
        """Make `experts` of `layer` ready on the compute stream and pin their slots until
        `release`. A failed read hands its slot back, unpins the wave and raises. `routing`
        (a call's first wave): each token's top-k ids, given to the policy with the step's
        `token_requests` (None when they are not this call's tokens)."""
        assert len(experts) <= self.num_slots, "caller must split experts into waves of max_batch"
        stream = self._stream
        if stream is not None and (stream.armed is not None or self.policy is not stream.base):
            self.policy = stream.call(layer)  # decode steps skip this: same policy, no cost
        self._advance()
        if layer != self._last_layer:
            self._drop_stale(self._last_layer)
            self._last_layer = layer
        keys = [ExpertKey(layer, e) for e in experts]
        if routing is None:
            self.policy.begin_call(layer, experts)
        else:
            requests = self.token_requests
            if requests is not None and len(requests) != len(routing):
                requests = None  # not this step's tokens: one anonymous request
            self.policy.begin_call(layer, experts, requests, routing)
        wave = _Wave(set(keys) | self.table.pinned_keys())
        start = time.perf_counter()
        try:
            for key in keys:
                self.stats.requests += 1
                slot = self.slot_of.get(key)
                if slot is not None:
                    self.stats.device_hits += 1
                    self.policy.touch(key)
                    self._note_use(slot, wave)
                else:
                    self._mark_wait(wave)
                    slot = self._start(key, ON_DEMAND, wave.exclude, wave)
                    assert slot is not None
                    wave.pending.append(slot)
                self.table.pin(slot)
                wave.slots.append(slot)
            late = go_late(self, wave)
            if not late:
                self._complete(wave)
        except BaseException:  # loads left behind finish in the background
            self.reads.start([ld.read for ld in self._loads_of(wave.pending) if ld.read])
            for s in wave.slots:
                self.table.unpin(s)
            raise
        if wave.error is not None:
            self._fail_wave(wave)
        if wave.waits:
            self.stats.miss_host_s += time.perf_counter() - start
        self._wait_ready(wave, start, late)
        waiter = (lambda slot: finish_late(self, slot)) if late else None
        split = self.packing.splitter(layer)
        return ExpertBatch(layer, experts, wave.slots, self.slots, split, late, waiter)

    def streaming(self, layer: int) -> None:
        """The next call of `layer` belongs to a streamed step (the MoE block says so before
        fetching): with `stream_eviction`, that call and what follows it until the next pick
        victims in the step's next-use order."""
        if self._stream is not None:
            self._stream.streaming(layer)

    def end_request(self, request_id: int) -> None:
        """The engine is done with `request_id` (finished, aborted or failed): tell the policy."""
        self.policy.end_request(request_id)

    def release(self, batch: ExpertBatch) -> None:
        settle_late(self, batch)  # unpins the slots (late reads: offload/late_reads.py)
        if not self.cuda:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for s in batch.slots:
            self.slot_free_event[s] = done

    def prefetch(self, layer: int, experts: Sequence[int], streamed: bool = False) -> int:
        """Start low-priority loads of `experts` of MoE layer `layer` into free slots or the
        policy's victims, never evicting a pinned slot, another key of `layer` (as likely to be
        needed as the guess) or cancelling another load; returns how many started. A later
        fetch of such a key is a hit that waits for its load.

        `streamed` (the next layer of a streamed step, all of whose experts will be used) with
        `stream_copy_now`: the copies of host-tier rows go on the copy stream at once, whole, as
        on-demand copies do, behind what is already there, and can no longer be cancelled. Fed
        through the pump instead, chunk by chunk, they move only when the pump thread gets the
        GIL, which the host's own work holds (on the H100, 128 queued 9.4 MB prefetches moved
        at 0.5-0.9 GB/s while the main thread ran Python, 29-47 GB/s while it waited:
        scripts/gpu_transfer_window.py).

        Called after the current layer's fetch: its unpinned loads still in progress are stale
        and are cancelled first."""
        owns = self.host.layout.owns  # expert parallelism: another rank's experts are its own
        if owns is not None:
            experts = [e for e in experts if owns(layer, e)]
        if self._resident_table is not None or not experts:
            return 0
        self._advance()
        self._drop_stale(self._last_layer)
        exclude = (
            self.table.pinned_keys() | self.table.loading_keys() | self.table.keys_of_layer(layer)
        )
        now = streamed and self.stream_copy_now
        started = 0
        for e in experts:
            key = ExpertKey(layer, e)
            if key in self.slot_of:
                continue
            if self._start(key, PREFETCH, exclude, now=now) is None:
                break
            exclude.add(key)
            started += 1
        self.stats.prefetches_issued += started
        return started

    # starting loads
    def _start(
        self,
        key: ExpertKey,
        priority: int,
        exclude: set[ExpertKey],
        wave: _Wave | None = None,
        now: bool = False,
    ) -> int | None:
        """Claim a slot for `key` and start its load; None (prefetch only) when a slot or a host
        row would have to be waited for. `now`: a host-tier row's copy is issued at once, whole
        (a prefetch keeps its priority everywhere else)."""
        urgent = priority == ON_DEMAND
        row = self.host.lookup(key)
        cached = row is not None
        direct = not cached and not self.cuda and not self.host.capacity
        if not cached and not direct:
            row = self._claim_row(urgent, wave)
            if row is None:
                return None
        slot = self._claim_slot(exclude, urgent)
        if slot is None:
            if row is not None and not cached:
                self.host.discard(row)
            return None
        load = Load(key, slot, priority, direct=direct)
        self.table.assign(slot, key, load, prefetched=not urgent)
        self.policy.insert(key)
        if row is not None:
            self.host.hold(row)
            load.row = row
        if cached:
            if urgent:
                self.stats.host_hits += 1
            self._start_copy(load, ON_DEMAND if now else priority)
        else:
            self._start_read(load)
        return slot

    def _claim_row(self, urgent: bool, wave: _Wave | None) -> int | None:
        row = self.host.claim_row(wait=urgent)
        if row is None and urgent:  # every row is held: prefetches yield theirs, then our own
            cancel_where(self, lambda load: load.row is not None)  # prefetches' rows
            row = self.host.claim_row(wait=True)
            if row is None and wave is not None:
                self._complete(wave)  # this wave's earlier loads issue their copies
                row = self.host.claim_row(wait=True)
            assert row is not None, "no host row can be claimed: every row is held"
        return row

    def _claim_slot(self, exclude: set[ExpertKey], urgent: bool) -> int | None:
        slot = self.table.take_free()
        if slot is not None:
            return slot
        try:
            victim = self.policy.victim(exclude=exclude)
        except RuntimeError:
            if urgent:
                raise
            return None
        self.policy.remove(victim)
        slot = self.slot_of[victim]
        s = self.table.slots[slot]
        if s.state is SlotState.LOADING:  # only prefetches are in progress outside a fetch
            cancel(self, s.load)
        elif s.prefetched:
            self.stats.prefetch_wasted_bytes += self.expert_bytes
        self.table.vacate(slot)
        self.stats.evictions += 1
        return slot

    def _start_read(self, load: Load) -> None:
        key, host = load.key, self.host
        if load.direct:
            slot = load.slot
            assert slot is not None
            fn = lambda: host.read_into(key, self._slot_rows[slot])  # noqa: E731
        else:
            row = load.row
            assert row is not None
            fn = lambda: host.read_into(key, host.row(row))  # noqa: E731
        # An on-demand read waits for its fetch's `_complete`: a lone miss is then read on the
        # fetching thread (no hand-off), several in parallel with the read threads.
        load.read = self.reads.submit(fn, load.priority, key, defer=load.priority == ON_DEMAND)

    def _start_copy(self, load: Load, priority: int) -> None:
        assert load.slot is not None and load.row is not None
        after = self.slot_free_event.pop(load.slot, None)
        load.copy = self.transfer.submit(
            load.key, self._slot_rows[load.slot], self.host.row(load.row), priority, after
        )
        if load.copy.fully_issued:
            self._copied(load)

    # moving loads on
    def _advance_load(self, load: Load, urgent: bool) -> None:
        """Move `load` as far as it can go; `urgent`: wait for its read (running it here if it
        has not started) and issue its copy now. Raises the read's error."""
        if load.read is not None:
            if not (urgent or load.read.done):
                return
            job, load.read = load.read, None
            self.host.count_read(*self.reads.wait(job))
            if load.direct:
                assert load.slot is not None
                self.table.mark_ready(load.slot)
                return
            assert load.row is not None
            self.host.install(load.key, load.row)
            self._start_copy(load, ON_DEMAND if urgent else load.priority)
        copy = load.copy
        if copy is None or load.slot is None or self.table.slots[load.slot].load is not load:
            return  # ready already
        if urgent and not copy.fully_issued:
            self.transfer.promote(copy)
        if copy.fully_issued:
            self._copied(load)

    def _copied(self, load: Load) -> None:
        copy = load.copy
        assert copy is not None and load.row is not None
        self.host.mark_in_flight(load.row, copy.event)
        self.host.unhold(load.row)
        load.row = None
        self.stats.bytes_host_to_device += copy.nbytes
        assert load.slot is not None
        self.table.mark_ready(load.slot, copy.event)

    def _advance(self) -> None:
        """Move prefetches on without blocking: reap finished reads, settle issued copies."""
        if self._detached:
            reap_detached(self)
        loading = self.table.loading_slots()
        if not loading:
            return
        self.transfer.pump()
        for slot in loading:
            if self.table.slots[slot].pins:  # a late load: its batch finishes it
                continue
            load = self.table.slots[slot].load
            try:
                self._advance_load(load, urgent=False)
            except Exception as exc:  # a failed prefetch read: the slot goes back, quietly
                log.debug("prefetch of %s failed: %s", load.key, exc)
                self.stats.prefetches_cancelled += 1
                self._drop(load)

    def _complete(self, wave: _Wave) -> None:
        """Finish the loads of the wave's pending slots, in order; the first waiting read runs
        on this thread, the others on the read threads meanwhile."""
        reads = [ld.read for ld in self._loads_of(wave.pending) if ld.read is not None]
        self.reads.start(reads[1:])
        for slot in wave.pending:
            load = self.table.slots[slot].load
            if load is None:
                continue
            try:
                self._advance_load(load, urgent=True)
            except Exception as exc:  # the slot is handed back once the wave is unpinned
                wave.failed.append(load)
                wave.error = wave.error or exc
        wave.pending.clear()

    def _loads_of(self, slots: list[int]) -> list[Load]:
        return [ld for ld in (self.table.slots[s].load for s in slots) if ld is not None]

    def _fail_wave(self, wave: _Wave) -> None:
        for s in wave.slots:
            self.table.unpin(s)
        for load in wave.failed:
            self._drop(load)
        assert wave.error is not None
        raise wave.error

    def _drop(self, load: Load) -> None:
        """Hand back the slot (and host row) of a load whose read failed or was cancelled."""
        if load.row is not None:
            self.host.unhold(load.row)
            self.host.discard(load.row)
        assert load.slot is not None
        key = self.table.vacate(load.slot)
        self.policy.remove(key)
        self.table.give_back(load.slot)

    # cancelling (offload/cancel.py)
    def _drop_stale(self, layer: int | None) -> None:
        """Cancel unpinned loads still in progress for `layer`, whose call has come and gone."""
        if layer is not None:
            cancel_where(self, lambda load: load.key.layer == layer)

    # hits and waits
    def _note_use(self, slot: int, wave: _Wave) -> None:
        s = self.table.slots[slot]
        pending = s.state is SlotState.LOADING
        if pending:
            wave.pending.append(slot)
        elif s.ready is not None and not self.transfer.copier.query(s.ready):
            pending = True
        if pending:
            self._mark_wait(wave)
        if s.prefetched:
            s.prefetched = False
            self.stats.prefetches_used += 1
            self.stats.prefetches_in_time += not pending

    def _mark_wait(self, wave: _Wave) -> None:
        """The compute stream will wait for a load: mark where (CUDA) before it is issued, so
        host-side issue time and disk reads count as exposed when nothing hides them."""
        wave.waits = True
        if self.cuda and wave.start_event is None:
            wave.start_event = torch.cuda.Event(enable_timing=True)
            wave.start_event.record(torch.cuda.current_stream(self.device))

    def _wait_ready(self, wave: _Wave, start: float, late: dict[int, int]) -> None:
        events = []
        for i, slot in enumerate(wave.slots):
            if i in late:
                continue
            s = self.table.slots[slot]
            assert s.state is SlotState.READY, f"{s.key} is {s.state.value} after its fetch"
            if s.ready is not None:
                events.append(s.ready)
                s.ready = None  # the compute stream is ordered after it from now on
        self.transfer.wait(events)
        if wave.start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self.stats.add_exposed_events(wave.start_event, end)
        elif wave.waits:
            self.stats.exposed_fetch_s += time.perf_counter() - start

    # introspection
    def resident(self) -> list[ExpertKey]:
        """Resident keys, next victim first (for tests and debugging)."""
        return [k for k in self.policy.order() if k in self.slot_of]

    def slot_state(self, key: ExpertKey) -> SlotState:
        slot = self.slot_of.get(key)
        return SlotState.FREE if slot is None else self.table.slots[slot].state

    def check_integrity(self, idle: bool = True) -> None:
        """Slot states, pins, policy and host tier agree; `idle` (between steps, the default):
        no slot is pinned. Prefetches may still be loading."""
        self.table.check(idle)
        assert set(self.policy.order()) == set(self.slot_of), "policy and slots disagree"
        rows: list[int] = []
        for slot in self.table.loading_slots():
            load = self.table.slots[slot].load
            assert load.slot == slot and load.key == self.table.slots[slot].key
            rows += [load.row] if load.row is not None else []
        for load in self._detached:
            assert load.slot is None and load.row is not None
            rows.append(load.row)
        held = {r: rows.count(r) for r in rows}
        assert held == self.host.held, f"held host rows {self.host.held} != loads' rows {held}"
        self.host.check_integrity()
        if self.device_cache is not None:
            assert not self.slot_of, "the host slot table is unused beside the device cache"
            self.device_cache.check_integrity()
