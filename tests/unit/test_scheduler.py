"""Scheduler: decode first, chunked prefill within the token budget, progress counters."""

from moetier.config import SchedulerConfig
from moetier.core import Request, SamplingParams
from moetier.engine.scheduler import Scheduler


def _req(i: int, n: int) -> Request:
    return Request(i, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_chunked_prefill_and_decode_share_budget() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10))
    a, b = _req(0, 6), _req(1, 12)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        (0, 6, True),
        (1, 4, False),
    ]
    a.num_computed_tokens, b.num_computed_tokens = 6, 4
    a.output_token_ids.append(99)  # a sampled its first token
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        (0, 1, True),
        (1, 8, True),
    ]


def test_max_num_seqs_limits_admission() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100))
    s.add(_req(0, 3))
    s.add(_req(1, 3))
    assert [x.request.request_id for x in s.schedule().scheduled] == [0]
    assert len(s.waiting) == 1
