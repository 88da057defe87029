"""The scheduler <-> runner contract: which requests run this step and how many tokens each."""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.core import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
