"""Decides each step's batch: running sequences first, then new prompts, within a token budget.

Pure Python; owns the waiting and running queues and who holds KV blocks, not the K/V tensors.
One progress counter per request (num_computed_tokens against num_tokens) drives prefill,
chunked prefill, decode and recompute after preemption alike: when blocks run out, the newest
running request is preempted (its blocks freed, its counter reset to 0) and requeued first.
"""

from __future__ import annotations

from collections import deque

from moetier.config import SchedulerConfig
from moetier.core import Request
from moetier.engine.batch import ScheduledRequest, SchedulerOutput
from moetier.engine.kv_cache import BlockManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager | None = None) -> None:
        self.config = config
        self.blocks = blocks  # None: no KV accounting (unit tests of the token budget)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = self.num_preemptions
        # Decodes (one token to compute) first, so a long prompt's chunk never stalls them.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if not self._is_running(req):
                continue  # preempted earlier in this step
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok, refund = self._reserve(req, n, out)
            budget += refund
            if ok:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
        # No admissions in a step that had to preempt: the freed blocks are for the older ones.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and preempted == self.num_preemptions
        ):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.blocks is not None:
                if not self.blocks.can_allocate(req.request_id, req.num_computed_tokens + n):
                    break
                self.blocks.allocate(req.request_id, req.num_computed_tokens + n)
            self.waiting.popleft()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _is_running(self, req: Request) -> bool:
        return any(r is req for r in self.running)

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate blocks for req's next n tokens, preempting the newest requests as needed.

        Returns (False when req itself was the newest and got preempted, tokens refunded by
        victims already scheduled in `out`, which are taken out of it).
        """
        if self.blocks is None:
            return True, 0
        need, refund = req.num_computed_tokens + n, 0
        while not self.blocks.can_allocate(req.request_id, need):
            victim = self.running[-1]
            self.preempt(victim)
            for s in [s for s in out.scheduled if s.request is victim]:
                out.scheduled.remove(s)
                refund += s.num_new_tokens
            if victim is req:
                return False, refund
        self.blocks.allocate(req.request_id, need)
        return True, refund

    def preempt(self, req: Request) -> None:
        """Free req's blocks and requeue it first; it recomputes its tokens when readmitted."""
        self.running = [r for r in self.running if r is not req]
        if self.blocks is not None:
            self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, request: Request) -> None:
        """Remove a running or waiting request and free its blocks."""
        self.running = [r for r in self.running if r is not request]
        self.waiting = deque(r for r in self.waiting if r is not request)
        if self.blocks is not None:
            self.blocks.free(request.request_id)

    def find(self, request_id: int) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None
