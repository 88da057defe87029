"""Transfer engine without CUDA: priority classes, chunking, cancellation and promotion of copies
(a fake copier records what reaches the "stream", in order), and the disk read pool's order."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from moetier.offload.transfer import (
    ON_DEMAND,
    PREFETCH,
    ReadPool,
    TransferEngine,
    split_chunks,
)


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.done = threading.Event()


class FakeCopier:
    """A FIFO "copy stream": each copy call is logged as (tag, first chunk, chunks); its event
    completes only when the test says so (or, for the pump thread, `auto` completes it)."""

    def __init__(self, tags: dict[int, str]) -> None:
        self.tags = tags  # dst storage offset -> name, to tell jobs apart in the log
        self.log: list[str] = []
        self.events: list[FakeEvent] = []
        self.waited: list[FakeEvent] = []
        self.syncing = threading.Event()  # set once a thread has entered `synchronize`
        self.lock = threading.Lock()

    def copy(self, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> FakeEvent:
        with self.lock:
            for dst, src in chunks:
                dst.copy_(src)
                base = dst.storage_offset()
                name = next(t for off, t in sorted(self.tags.items(), reverse=True) if off <= base)
                first = min(off for off, t in self.tags.items() if t == name)
                self.log.append(f"{name}{(base - first) // dst.numel() if dst.numel() else 0}")
            ev = FakeEvent("+".join(self.log[-len(chunks) :]))
            self.events.append(ev)
            return ev

    def query(self, event: Any) -> bool:
        return event is None or event.done.is_set()

    def wait(self, event: Any) -> None:
        self.waited.append(event)

    def synchronize(self, event: Any) -> None:
        self.syncing.set()
        assert event.done.wait(5.0), "test never completed the chunk"

    def complete_all(self) -> None:
        with self.lock:
            for ev in self.events:
                ev.done.set()


def _buffers(names: str, numel: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:
    """One dst and one src row per job name, in one storage so the copier can name them."""
    dst = torch.zeros(len(names), numel)
    src = torch.arange(len(names) * numel, dtype=torch.float32).view(len(names), numel)
    return dst, src, {i * numel: n for i, n in enumerate(names)}


def test_split_chunks_even_pieces_cover_everything() -> None:
    dst, src = torch.zeros(10), torch.arange(10.0)
    chunks = split_chunks(dst, src, chunk_bytes=16)  # 40 bytes -> 3 pieces of 4, 4, 2 floats
    assert [d.numel() for d, _ in chunks] == [4, 4, 2]
    assert [d.storage_offset() for d, _ in chunks] == [0, 4, 8]
    for d, s in chunks:
        d.copy_(s)
    assert torch.equal(dst, src)
    assert len(split_chunks(dst, src, chunk_bytes=1 << 20)) == 1


def test_on_demand_copy_overtakes_queued_prefetches() -> None:
    dst, src, tags = _buffers("ABD", 8)  # 32 bytes each; chunks of 16 bytes: 2 per prefetch
    copier = FakeCopier(tags)
    engine = TransferEngine(copier, chunk_bytes=16, window=1)
    a = engine.submit("A", dst[0], src[0], PREFETCH)
    b = engine.submit("B", dst[1], src[1], PREFETCH)
    assert copier.log == ["A0"]  # one prefetch chunk on the stream, the rest queued
    d = engine.submit("D", dst[2], src[2], ON_DEMAND)
    assert copier.log == ["A0", "D0"]  # issued at once, whole: behind exactly one chunk
    assert d.fully_issued and not a.fully_issued and b.issued == 0
    assert engine.pump() == 0  # A0 not complete yet: the window is full
    for _ in range(3):
        copier.complete_all()
        engine.pump()
    assert copier.log == ["A0", "D0", "A1", "B0", "B1"]  # FIFO stream: D completes second
    assert torch.equal(dst, src)
    assert not engine.query(b)  # B1 is issued, not complete
    copier.complete_all()
    assert engine.query(a) and engine.query(b) and engine.query(d)


def test_window_keeps_that_many_prefetch_chunks_on_the_stream() -> None:
    dst, src, tags = _buffers("ABD", 8)  # 2 chunks a prefetch
    copier = FakeCopier(tags)
    engine = TransferEngine(copier, chunk_bytes=16, window=3)
    engine.submit("A", dst[0], src[0], PREFETCH)
    engine.submit("B", dst[1], src[1], PREFETCH)
    assert copier.log == ["A0", "A1", "B0"]  # three chunks queued on the stream back to back
    engine.submit("D", dst[2], src[2], ON_DEMAND)
    assert copier.log == ["A0", "A1", "B0", "D0"]  # a miss waits behind the window's chunks
    assert engine.pump() == 0  # none complete: the window is full
    copier.events[0].done.set()  # A0 done: one place free
    assert engine.pump() == 1 and copier.log[-1] == "B1"
    copier.complete_all()
    assert torch.equal(dst, src)


def test_cancel_drops_unissued_chunks_and_stale_jobs() -> None:
    dst, src, tags = _buffers("ABC", 8)
    copier = FakeCopier(tags)
    engine = TransferEngine(copier, chunk_bytes=16, window=1)
    a = engine.submit("A", dst[0], src[0], PREFETCH)
    b = engine.submit("B", dst[1], src[1], PREFETCH)
    c = engine.submit("C", dst[2], src[2], PREFETCH)
    assert engine.cancel(b) == 0  # stale before any chunk: nothing moved
    assert engine.cancel(a) == 16  # one chunk already on the stream still lands
    assert engine.pending() == 1
    for _ in range(3):
        copier.complete_all()
        engine.pump()
    assert copier.log == ["A0", "C0", "C1"]
    assert c.fully_issued and not a.fully_issued and b.issued == 0
    assert torch.equal(dst[1], torch.zeros(8))


def test_promote_issues_the_rest_ahead_of_queued_prefetches() -> None:
    dst, src, tags = _buffers("AB", 12)  # 48 bytes: 3 chunks of 16
    copier = FakeCopier(tags)
    engine = TransferEngine(copier, chunk_bytes=16, window=1)
    engine.submit("A", dst[0], src[0], PREFETCH)
    b = engine.submit("B", dst[1], src[1], PREFETCH)
    engine.promote(b)  # a step needs B now
    assert copier.log == ["A0", "B0", "B1", "B2"] and b.fully_issued
    assert copier.events[-1].name == "B0+B1+B2"  # one event for the promoted rest
    for _ in range(3):
        copier.complete_all()
        engine.pump()
    assert copier.log[4:] == ["A1", "A2"]


def test_pump_thread_feeds_one_chunk_at_a_time() -> None:
    dst, src, tags = _buffers("AB", 8)
    copier = FakeCopier(tags)
    engine = TransferEngine(copier, chunk_bytes=16, window=1, background=True)
    engine.submit("A", dst[0], src[0], PREFETCH)
    engine.submit("B", dst[1], src[1], PREFETCH)
    for n in range(1, 5):
        deadline = time.monotonic() + 5.0
        while len(copier.log) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(copier.log) == n  # never a second chunk while the first is in flight
        time.sleep(0.01)
        assert len(copier.log) == n
        copier.complete_all()
    assert copier.log == ["A0", "A1", "B0", "B1"]


def test_read_pool_runs_on_demand_before_queued_prefetches() -> None:
    pool = ReadPool(threads=1)
    order: list[str] = []
    gate = threading.Event()

    def job(name: str) -> Any:
        def run() -> str:
            if name == "blocker":
                assert gate.wait(5.0)
            order.append(name)
            return name

        return run

    blocker = pool.submit(job("blocker"), PREFETCH, "blocker")
    while blocker.state != "running":
        time.sleep(0.001)
    p1 = pool.submit(job("p1"), PREFETCH, "p1")
    p2 = pool.submit(job("p2"), PREFETCH, "p2")
    d = pool.submit(job("d"), ON_DEMAND, "d")
    assert pool.queued() == ["d", "p1", "p2"]
    gate.set()
    assert [pool.wait(j) for j in (blocker, d, p1, p2)] == ["blocker", "d", "p1", "p2"]
    assert order == ["blocker", "d", "p1", "p2"]


def test_read_pool_waiter_runs_a_queued_read_itself_and_gets_errors() -> None:
    pool = ReadPool(threads=1)
    gate = threading.Event()
    ran_on: list[str] = []
    busy = pool.submit(lambda: gate.wait(5.0), PREFETCH)
    while busy.state != "running":
        time.sleep(0.001)
    mine = pool.submit(lambda: ran_on.append(threading.current_thread().name), ON_DEMAND)
    skipped = pool.submit(lambda: ran_on.append("never"), PREFETCH)
    assert pool.cancel(skipped) and not pool.cancel(busy)
    pool.wait(mine)  # the only worker is busy: the waiter runs it
    assert ran_on == [threading.current_thread().name]

    def fail() -> None:
        raise OSError(5, "Input/output error", "model.safetensors")

    broken = pool.submit(fail, ON_DEMAND)
    with pytest.raises(OSError, match="Input/output error"):
        pool.wait(broken)
    gate.set()
    assert pool.wait(busy) is True
    assert ran_on == [threading.current_thread().name]  # the cancelled read never ran


def test_paused_engine_issues_nothing_and_its_thread_makes_no_call() -> None:
    dst, src, tags = _buffers("ABD", 8)
    copier = FakeCopier(tags)
    engine = TransferEngine(copier, chunk_bytes=16, window=1, background=True)
    engine.submit("A", dst[0], src[0], PREFETCH)
    assert copier.syncing.wait(5.0)  # the pump thread is inside its wait on A0's event
    held, release = threading.Event(), threading.Event()
    seen: list[list[str]] = []

    def capture() -> None:  # waits until the thread's wait on A0 is over, then holds the engine
        with engine.paused():
            held.set()
            assert release.wait(5.0)
            seen.append(list(copier.log))

    t = threading.Thread(target=capture)
    t.start()
    time.sleep(0.01)
    assert not held.is_set()  # the pump thread is still waiting on A0's event
    copier.complete_all()
    assert held.wait(5.0)
    engine.submit("B", dst[1], src[1], PREFETCH)
    engine.submit("D", dst[2], src[2], ON_DEMAND)
    assert engine.pump() == 0
    time.sleep(0.02)
    release.set()
    t.join()
    assert seen == [["A0", "D0"]]  # prefetch chunks held back; on-demand copies still go
    for n in (3, 4, 5):
        deadline = time.monotonic() + 5.0
        while len(copier.log) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        copier.complete_all()
    assert copier.log == ["A0", "D0", "A1", "B0", "B1"]
