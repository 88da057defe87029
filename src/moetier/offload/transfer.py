"""Moves packed experts between tiers in priority order: host->device copies on the copy stream,
disk reads on a small pool of threads.

Owns the copy stream, readiness events, the two priority queues (copies and reads) and the
read threads; never decides what to move or where (the expert cache does), and never touches
cache bookkeeping from a background thread (threads only run copies and reads).

Two service classes: ON_DEMAND (a step is waiting) before PREFETCH (a guess). Within a class,
first come first served.

Copies. An on-demand copy goes on the copy stream at once. Prefetch copies wait in a host-side
queue, split into chunks of `chunk_bytes`, and are fed to the stream one chunk at a time: at
most `window` prefetch chunks sit on the stream, so an on-demand copy issued later waits behind
at most that many chunks. A queued prefetch can be cancelled (stale, or its slot is needed) or
promoted (a step needs it now: its remaining chunks are issued at once). On CUDA a pump thread
waits (blocking event, off the compute path) for the chunk on the stream to finish and issues
the next; the compute stream only ever waits on events (`wait`), never the host.

Why a host queue and not two streams with `torch.cuda.Stream(priority=...)`: stream priorities
order kernels on the SMs, not DMA on the copy engines; two copy streams share the link rather
than one yielding to the other, and a copy already on a stream cannot be cancelled. A queue fed
a chunk at a time keeps prefetches cancellable until issued and bounds how long a miss waits.

Reads. `ReadPool` runs disk reads on up to `threads` background threads, on-demand first; a
waiter whose read has not started runs it itself (no hand-off latency for a lone miss). Threads
start on demand and exit when idle, so an unused pool costs nothing.

`Load` (at the end) is the unit the expert cache schedules: one expert's read, then its copy.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moetier.offload.types import ExpertKey

ON_DEMAND = 0  # a step waits for it
PREFETCH = 1  # a guess: below every on-demand transfer, cancellable until issued

DEFAULT_CHUNK_BYTES = 8 << 20  # ~0.15 ms at 55 GB/s; copies of >= 8 MB run at full link speed
IDLE_EXIT_S = 2.0  # background threads exit after this long without work

Chunk = tuple[torch.Tensor, torch.Tensor]  # (dst, src) views of equal size


class Copier(Protocol):
    """Issues copies and answers for their completion events (CUDA stream, CPU, or a fake)."""

    def copy(self, chunks: Sequence[Chunk], after: Any | None) -> Any | None:
        """Issue `chunks` in order once `after` (an event, or None) has completed; return an
        event that completes when they are done (None: done already)."""
        ...

    def query(self, event: Any) -> bool:
        """Whether `event` has completed; never blocks."""
        ...

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for `event`; never blocks the host."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the calling (background) thread until `event` completes."""
        ...


class SyncCopier:
    """CPU compute device: a copy is a plain synchronous memcpy, done when `copy` returns."""

    def copy(self, chunks: Sequence[Chunk], after: Any | None) -> None:
        for dst, src in chunks:
            dst.copy_(src)
        return None

    def query(self, event: Any) -> bool:
        return True

    def wait(self, event: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass


class CudaCopier:
    """Copies on one dedicated copy stream; one blocking-sync event per issue, so the pump
    thread sleeps (does not spin) while it waits for a chunk."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, chunks: Sequence[Chunk], after: Any | None) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # the slot's last compute use has finished
            for dst, src in chunks:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
        return done

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


@dataclass(eq=False)
class CopyJob:
    """One expert's copy into one slot, as chunks issued in order."""

    tag: Any  # what is being copied (the cache passes the ExpertKey); for tests and logs
    priority: int
    chunks: list[Chunk]
    after: Any | None  # event the first chunk waits for (the slot's last compute use)
    seq: int
    issued: int = 0  # chunks on the stream
    issued_bytes: int = 0
    event: Any | None = None  # completion of everything issued so far
    cancelled: bool = False
    nbytes: int = field(init=False)  # every chunk's bytes (counted once: the miss path)

    def __post_init__(self) -> None:
        self.nbytes = sum(_nbytes(d) for d, _ in self.chunks)

    @property
    def fully_issued(self) -> bool:
        return self.issued == len(self.chunks)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def split_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> list[Chunk]:
    """Flat (dst, src) cut into ceil(bytes / chunk_bytes) nearly equal pieces (equal pieces keep
    each copy large enough to run at link speed: no small tail)."""
    assert dst.shape == src.shape and dst.dim() == 1, "experts move as flat packed buffers"
    pieces = max(1, -(-_nbytes(dst) // max(chunk_bytes, 1)))
    step = -(-dst.numel() // pieces)
    return [(dst[i : i + step], src[i : i + step]) for i in range(0, dst.numel(), step)]


class TransferEngine:
    """Host->device copies in priority order (see the module docstring)."""

    def __init__(
        self,
        copier: Copier,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int | None = 1,
        background: bool = False,
    ) -> None:
        self.copier = copier
        self.chunk_bytes = chunk_bytes
        self.window = window  # prefetch chunks on the stream at once; None = no limit
        self.background = background
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, CopyJob]] = []  # (priority, seq, job); lazy removal
        self._in_flight: deque[Any] = deque()  # events of prefetch chunks on the stream
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._paused = 0  # > 0: no prefetch chunk is issued and the pump thread makes no CUDA call
        self._busy = False  # the pump thread is waiting on a chunk's event

    def submit(
        self,
        tag: Any,
        dst: torch.Tensor,
        src: torch.Tensor,
        priority: int,
        after: Any | None = None,
    ) -> CopyJob:
        """Copy src into dst. ON_DEMAND: issued now, whole. PREFETCH: queued in chunks."""
        if priority == ON_DEMAND:
            job = CopyJob(tag, priority, [(dst, src)], after, next(self._seq))
            with self._cond:
                self._issue(job, 1)
            return job
        job = CopyJob(
            tag, priority, split_chunks(dst, src, self.chunk_bytes), after, next(self._seq)
        )
        with self._cond:
            heapq.heappush(self._queue, (priority, job.seq, job))
            self._pump_locked()
            if self.background:
                self._ensure_thread()
                self._cond.notify_all()
        return job

    def promote(self, job: CopyJob) -> None:
        """A step needs `job` now: issue what is left of it at once, ahead of queued prefetches
        (at most `window` prefetch chunks are already on the stream before it)."""
        with self._cond:
            if not job.cancelled and not job.fully_issued:
                job.priority = ON_DEMAND
                self._issue(job, len(job.chunks) - job.issued)

    def cancel(self, job: CopyJob) -> int:
        """Drop the chunks of `job` not yet issued; return the bytes already issued (they still
        land: a later copy into the same slot goes on the same stream, after them)."""
        with self._cond:
            job.cancelled = True
            return job.issued_bytes

    def pump(self) -> int:
        """Issue queued prefetch chunks while the window allows; return how many were issued."""
        with self._cond:
            return self._pump_locked()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While held, queued prefetch chunks wait and the pump thread makes no CUDA call: a
        CUDA-graph capture (global mode) fails on any thread's event query or sync. On-demand
        copies are not affected (the capturing thread issues none)."""
        with self._cond:
            self._paused += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def pending(self) -> int:
        """Queued jobs with chunks not yet issued (cancelled ones excluded)."""
        with self._cond:
            return sum(1 for _, _, j in self._queue if not (j.cancelled or j.fully_issued))

    def query(self, job: CopyJob) -> bool:
        """Whether every chunk of `job` is issued and complete; never blocks."""
        return job.fully_issued and self.copier.query(job.event)

    def wait(self, events: Sequence[Any]) -> None:
        """Make the compute stream wait for `events`; never blocks the host."""
        for ev in events:
            self.copier.wait(ev)

    # internals (called with the lock held)
    def _issue(self, job: CopyJob, n: int) -> None:
        chunks = job.chunks[job.issued : job.issued + n]
        after = job.after if job.issued == 0 else None
        job.event = self.copier.copy(chunks, after)
        job.issued += len(chunks)
        if job.fully_issued:  # an on-demand copy is one chunk: no sum
            job.issued_bytes = job.nbytes
        else:
            job.issued_bytes += sum(_nbytes(d) for d, _ in chunks)

    def _pump_locked(self) -> int:
        if self._paused:
            return 0
        while self._in_flight and self.copier.query(self._in_flight[0]):
            self._in_flight.popleft()
        issued = 0
        while self._queue and (self.window is None or len(self._in_flight) < self.window):
            job = self._queue[0][2]
            if job.cancelled or job.fully_issued:
                heapq.heappop(self._queue)
                continue
            self._issue(job, 1)
            issued += 1
            if job.event is not None:
                self._in_flight.append(job.event)
            if job.fully_issued:
                heapq.heappop(self._queue)
        return issued

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="moetier-copy", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        """Pump thread: issue the next prefetch chunk whenever the one on the stream is done."""
        with torch.inference_mode():
            while True:
                with self._cond:
                    self._pump_locked()
                    while self._paused or not self._in_flight:
                        timed_out = not self._cond.wait(IDLE_EXIT_S)
                        self._pump_locked()
                        idle = not self._in_flight and not self._queue
                        if timed_out and idle and not self._paused:
                            self._thread = None
                            return
                    head = self._in_flight[0]
                    self._busy = True
                try:
                    self.copier.synchronize(head)  # this thread only: compute never waits
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()


@dataclass(eq=False)
class ReadJob:
    """One disk read on the pool; `wait` returns its result or raises its error."""

    fn: Callable[[], Any]
    priority: int
    seq: int
    tag: Any = None
    state: str = "queued"  # queued | running | done | cancelled
    started: bool = False  # handed to the threads (a deferred job is not, until `start`)
    result: Any = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self.finished.is_set()


class ReadPool:
    """Disk reads on up to `threads` background threads, on-demand before prefetch."""

    def __init__(self, threads: int = 2, idle_s: float = IDLE_EXIT_S) -> None:
        self.threads = max(1, threads)
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, ReadJob]] = []
        self._seq = itertools.count()
        self._workers = 0

    def submit(
        self, fn: Callable[[], Any], priority: int, tag: Any = None, defer: bool = False
    ) -> ReadJob:
        """Queue a read. `defer`: not handed to the threads until `start` (a caller about to
        wait for it runs it itself, with no thread hand-off)."""
        job = ReadJob(fn, priority, next(self._seq), tag)
        if not defer:
            self.start([job])
        return job

    def start(self, jobs: Sequence[ReadJob]) -> None:
        """Hand deferred jobs to the threads."""
        with self._cond:
            for job in jobs:
                if job.state == "queued" and not job.started:
                    job.started = True
                    heapq.heappush(self._queue, (job.priority, job.seq, job))
            while self._workers < min(self.threads, len(self._queue)):
                self._workers += 1
                threading.Thread(target=self._worker, name="moetier-read", daemon=True).start()
            self._cond.notify(len(jobs))

    def cancel(self, job: ReadJob) -> bool:
        """Cancel `job` if it has not started (it will never run); False if it has."""
        with self._cond:
            if job.state != "queued":
                return False
            job.state = "cancelled"
            job.finished.set()
            return True

    def wait(self, job: ReadJob) -> Any:
        """The job's result (or its error, raised); a job not yet started runs here, now."""
        with self._cond:
            inline = job.state == "queued"
            if inline:
                job.state = "running"
        if inline:
            self._run(job)
        job.finished.wait()
        assert job.state == "done", f"waited for a {job.state} read"
        if job.error is not None:
            raise job.error
        return job.result

    def queued(self) -> list[Any]:
        """Tags of queued jobs in the order they will start (for tests and debugging)."""
        with self._cond:
            live = sorted(e for e in self._queue if e[2].state == "queued")
            return [j.tag for _, _, j in live]

    def _run(self, job: ReadJob) -> None:
        try:
            with torch.inference_mode():
                job.result = job.fn()
        except BaseException as exc:  # handed to the waiter, who raises it
            job.error = exc
        job.fn = _done_fn  # drop the closure (it holds tensor views)
        with self._cond:
            job.state = "done"
        job.finished.set()

    def _next_locked(self) -> ReadJob | None:
        while self._queue:
            job = heapq.heappop(self._queue)[2]
            if job.state == "queued":
                job.state = "running"
                return job
        return None

    def _worker(self) -> None:
        while True:
            with self._cond:
                job = self._next_locked()
                while job is None:
                    timed_out = not self._cond.wait(self.idle_s)
                    job = self._next_locked()
                    if job is None and timed_out:
                        self._workers -= 1
                        return
            self._run(job)


def _done_fn() -> None:
    raise AssertionError("a read job ran twice")


@dataclass(eq=False)
class Load:
    """One expert on its way into one slot: a disk read, then a host->slot copy."""

    key: ExpertKey
    slot: int | None  # None once detached (cancelled while its read into a host row runs)
    priority: int
    direct: bool = False  # the read goes straight into the slot (CPU, no host tier)
    row: int | None = None  # host row read into / copied from; held while the load uses it
    read: ReadJob | None = None
    copy: CopyJob | None = None
