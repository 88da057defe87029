"""Moves packed experts from host buffers into device slots on a dedicated copy stream.

Owns the copy stream and the readiness events; never decides what to move (the cache does).
On CUDA each load records one event that the compute stream waits on; no host sync here.
On the CPU a load is a plain synchronous copy.
"""

from __future__ import annotations

import torch


class TransferEngine:
    """Issues host->device expert copies; one event per load."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy src into dst; on CUDA, after `after` (the slot's last use) has completed."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=False)
            done.record(self.stream)
        return done

    def wait(self, events: list[torch.cuda.Event]) -> None:
        """Make the current (compute) stream wait for `events`; never blocks the host."""
        stream = torch.cuda.current_stream(self.device)
        for ev in events:
            stream.wait_event(ev)
