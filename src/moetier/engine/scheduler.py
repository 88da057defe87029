"""Decides each step's batch: running sequences first, then new prompts, within a token budget.

Pure Python. One progress counter per request (num_computed_tokens against num_tokens) drives
prefill, chunked prefill and decode alike.
"""

from __future__ import annotations

from collections import deque

from moetier.config import SchedulerConfig
from moetier.core import Request
from moetier.engine.batch import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def finish(self, request: Request) -> None:
        self.running.remove(request)
