"""The server's engine-output reader thread after shutdown: the event loop is closed when the
engine process's last messages or its exit arrive; the thread must end quietly (a traceback
there once failed the SIGTERM test and alarms operators)."""

from __future__ import annotations

import asyncio
import queue
from types import SimpleNamespace

from moetier.server.engine_process import EngineClient


class _Queue:
    def __init__(self, items: list[object]) -> None:
        self.items = items

    def get(self, timeout: float) -> object:
        if self.items:
            return self.items.pop(0)
        raise queue.Empty


def _client(items: list[object], alive: bool) -> EngineClient:
    client = object.__new__(EngineClient)  # no engine process: only the reader's fields
    loop = asyncio.new_event_loop()
    loop.close()
    client._loop = loop
    client.out_q = _Queue(items)  # type: ignore[assignment]
    client.proc = SimpleNamespace(is_alive=lambda: alive, exitcode=0)  # type: ignore[assignment]
    return client


def test_reader_ends_quietly_when_the_engine_exits_after_the_loop_closed() -> None:
    client = _client([], alive=False)
    client._read()  # returns (before: RuntimeError "Event loop is closed" from the thread)
    assert not client._post(print, "x")


def test_reader_stops_at_a_message_it_can_no_longer_deliver() -> None:
    client = _client([("deltas", [])], alive=True)
    client._read()  # the closed loop refuses the message: the thread ends instead of spinning
    assert client.out_q.items == []  # type: ignore[attr-defined]
