"""Decides each step's batch: running sequences first, then new prompts, within a token budget.

Pure Python; owns the waiting and running queues and who holds KV blocks, not the K/V tensors.
One progress counter per request (num_computed_tokens against num_tokens) drives prefill,
chunked prefill, decode and recompute after preemption alike: when blocks run out, the newest
running request is preempted (its blocks freed, its counter reset to 0) and requeued first.
With prefix caching, an admitted request's counter starts at the tokens its cached prefix
blocks already hold (a preempted one may hit its own blocks), and `computed` hashes the blocks
a step filled.
"""

from __future__ import annotations

from collections import deque

from moetier.config import SchedulerConfig
from moetier.core import Request
from moetier.engine.batch import ScheduledRequest, SchedulerOutput
from moetier.engine.block_manager import BlockManager
from moetier.engine.state_cache import StateSlots


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager | None = None,
        states: StateSlots | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks  # None: no KV accounting (unit tests of the token budget)
        self.states = states  # None: the model keeps no per-sequence recurrent state
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Prefix cache, counted at admission: tokens of the admitted requests looked up, and
        # the tokens their cached prefix blocks held (not recomputed).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
            if not self._admit(req, budget):
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self.waiting.popleft()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _admit(self, req: Request, budget: int) -> bool:
        """Allocate blocks for a waiting request's first chunk, starting its table with its
        cached prefix blocks and its counter at the tokens they hold; False if it does not fit
        (nothing changed)."""
        states = self.states
        if states is not None and req.request_id not in states.slot_of and not states.num_free:
            return False
        if self.blocks is None:
            if self.states is not None:
                self.states.assign(req.request_id)
            return True
        assert req.num_computed_tokens == 0, "a waiting request has computed nothing"
        prefix = self.blocks.match_prefix(req.all_token_ids)
        start = len(prefix) * self.blocks.block_size
        need = start + min(req.num_tokens - start, budget)
        if not self.blocks.can_allocate(req.request_id, need, prefix):
            return False
        self.blocks.allocate(req.request_id, need, prefix)
        if self.states is not None:
            self.states.assign(req.request_id)
        req.num_computed_tokens = start
        if req.num_cached_tokens is None:
            req.num_cached_tokens = start
        if self.blocks.prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += start
        return True

    def computed(self, req: Request) -> None:
        """A step computed req's K/V up to its counter: its newly full blocks become cached."""
        if self.blocks is not None:
            self.blocks.cache_full_blocks(
                req.request_id, req.num_computed_tokens, req.prompt_token_ids, req.output_token_ids
            )

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
        if self.states is not None:
            self.states.free(req.request_id)  # its states restart from token 0 too
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, request: Request) -> None:
        """Remove a running or waiting request and free its blocks (and state slot)."""
        self.running = [r for r in self.running if r is not request]
        self.waiting = deque(r for r in self.waiting if r is not request)
        if self.blocks is not None:
            self.blocks.free(request.request_id)
        if self.states is not None:
            self.states.free(request.request_id)

    def check_integrity(self) -> None:
        """Waiting requests hold no blocks and have computed nothing; each running request's
        table covers its computed tokens; then the block manager's own invariants. With state
        slots: exactly the running requests hold one."""
        if self.states is not None:
            held = {r.request_id for r in self.running}
            assert set(self.states.slot_of) == held, "state slots differ from the running requests"
            self.states.check_integrity()
        if self.blocks is None:
            return
        for req in self.waiting:
            assert req.num_computed_tokens == 0, "a waiting request has computed tokens"
            assert req.request_id not in self.blocks.tables, "a waiting request holds blocks"
        for req in self.running:
            have = len(self.blocks.tables.get(req.request_id, ()))
            assert self.blocks.blocks_for(req.num_computed_tokens) <= have, "K/V without blocks"
        self.blocks.check_integrity()

    def find(self, request_id: int) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None
