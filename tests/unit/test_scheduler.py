"""Scheduler: decode first, chunked prefill within the token budget, progress counters."""

from moetier.config import SchedulerConfig
from moetier.core import Request, SamplingParams
from moetier.engine.batch import SchedulerOutput
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


def test_preempts_newest_when_blocks_run_out() -> None:
    from moetier.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=3, block_size=2)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), blocks)
    a, b = _req(0, 2), _req(1, 2)
    s.add(a)
    s.add(b)
    assert [x.request.request_id for x in s.schedule().scheduled] == [0, 1]
    assert blocks.tables == {0: [0], 1: [1]}
    for r in (a, b):
        r.num_computed_tokens = 2
        r.output_token_ids.append(9)
    # a needs a 2nd block (block 2); then b needs one too and none is left: b (newest) preempts
    # itself and goes back to the front of the queue with its progress reset
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [(0, 1)]
    assert s.num_preemptions == 1 and list(s.waiting) == [b] and b.num_computed_tokens == 0
    assert blocks.tables == {0: [0, 2]}
    s.finish(a)
    assert blocks.num_used == 0
    out = s.schedule()  # b recomputes prompt + its sampled token, then samples the next
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        (1, 3, True)
    ]
    blocks.check_integrity()


def test_waiting_request_waits_for_blocks() -> None:
    from moetier.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=2, block_size=2)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), blocks)
    s.add(_req(0, 4))
    s.add(_req(1, 2))
    assert [x.request.request_id for x in s.schedule().scheduled] == [0]
    assert [r.request_id for r in s.waiting] == [1]


def test_decodes_go_before_an_older_long_prefill() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8))
    long, short = _req(0, 30), _req(1, 2)
    s.add(long)
    s.add(short)
    assert [(x.request.request_id, x.num_new_tokens) for x in s.schedule().scheduled] == [(0, 8)]
    long.num_computed_tokens = 8
    s.running.append(s.waiting.popleft())  # admitted later (as if budget had allowed)
    short.num_computed_tokens = 2
    short.output_token_ids.append(5)  # short is decoding: it goes first, long gets the rest
    assert [(x.request.request_id, x.num_new_tokens) for x in s.schedule().scheduled] == [
        (1, 1),
        (0, 7),
    ]


def test_preempting_a_scheduled_decode_refunds_its_budget() -> None:
    from moetier.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=3, block_size=2)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), blocks)
    old, new = _req(0, 3), _req(1, 2)  # old prefills in 2 chunks; new decodes
    s.running = [old, new]
    blocks.allocate(0, 2)
    blocks.allocate(1, 2)
    old.num_computed_tokens = 1  # one chunk done (2 tokens left: not a decode)
    new.num_computed_tokens = 2
    new.output_token_ids.append(9)
    # new (decode) is scheduled first and takes the last block; old then needs a block:
    # new is the newest, is preempted, and leaves the batch
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [(0, 2)]
    assert list(s.waiting) == [new] and s.num_preemptions == 1
    assert blocks.tables == {0: [0, 1]}  # new's blocks [1, 2] came back; 1 is reused first
    blocks.check_integrity()


def _step(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a step: advance the counters and cache the full blocks."""
    for x in out.scheduled:
        samples = x.samples
        x.request.num_computed_tokens += x.num_new_tokens
        s.computed(x.request)
        if samples:
            x.request.output_token_ids.append(9)  # the sampled token


def test_admission_starts_at_the_cached_prefix_and_counts_it() -> None:
    from moetier.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=8, block_size=2, prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), blocks)
    a = _req(0, 5)  # [1..5]: blocks [1, 2], [3, 4] full
    s.add(a)
    _step(s, s.schedule())
    s.finish(a)
    b = _req(1, 6)  # [1..6]: the same two blocks, then [5, 6] to compute
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        (1, 2, True)
    ]
    # a's partial block 2 ([5]) was freed, not cached, and is reused first
    assert b.num_computed_tokens == 4 and blocks.tables[1] == [0, 1, 2]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (5 + 6, 4)
    s.check_integrity()


def test_a_preempted_request_hits_its_own_blocks_on_recompute() -> None:
    from moetier.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=6, block_size=2, prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), blocks)
    a, b = _req(0, 4), Request(1, [5, 6, 7, 8, 10], SamplingParams(max_tokens=4))
    s.add(a)
    s.add(b)
    _step(s, s.schedule())
    assert blocks.tables == {0: [0, 1], 1: [2, 3, 4]}
    s.preempt(b)  # [5, 6] and [7, 8] stay cached; the partial block 4 is freed
    assert list(blocks.evictable) == [3, 2] and b.num_computed_tokens == 0
    out = s.schedule()  # a grows into block 4 (freed last, reused first); b hits 2 blocks
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [(0, 1), (1, 2)]
    assert blocks.tables == {0: [0, 1, 4], 1: [2, 3, 5]} and b.num_computed_tokens == 4
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (4 + 5 + 6, 4)
    s.check_integrity()


def test_chunked_prefill_caches_blocks_as_chunks_complete() -> None:
    from moetier.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=8, block_size=2, prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=3), blocks)
    a, b = _req(0, 7), _req(1, 7)  # same prompt; b waits (one sequence at a time)
    s.add(a)
    s.add(b)
    _step(s, s.schedule())  # a computes 3 tokens: block 0 full
    assert len(blocks.hash_of) == 1
    _step(s, s.schedule())  # 6 tokens: blocks 0, 1, 2 full
    assert len(blocks.hash_of) == 3
    _step(s, s.schedule())  # the 7th token, and a samples
    s.finish(a)
    out = s.schedule()  # b reuses 3 blocks (6 tokens) and computes its last token
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        (1, 1, True)
    ]
    assert blocks.tables[1][:3] == [0, 1, 2] and s.prefix_cache_hits == 6
    s.check_integrity()


def test_random_traffic_never_writes_a_shared_block_and_reads_its_own_tokens() -> None:
    """Engine steps simulated on a tiny pool (arrivals sharing prefixes, chunked prefill,
    preemption, aborts): every position a chunk writes lies in a block only its request holds
    and no hash names, every position it reads holds K/V of its own token prefix, and the
    invariants hold after each step."""
    import random

    from moetier.engine.block_manager import BlockManager

    rng = random.Random(7)
    blocks = BlockManager(num_blocks=10, block_size=2, prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7), blocks)
    written: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix its K/V was computed for
    bases = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7]]
    next_id = 0
    for _ in range(2000):
        if rng.random() < 0.4:
            tail = [rng.randint(1, 3)] * rng.randint(0, 5)
            prompt = rng.choice(bases)[: rng.randint(1, 6)] + tail
            s.add(Request(next_id, prompt, SamplingParams(max_tokens=rng.randint(1, 6))))
            next_id += 1
        if rng.random() < 0.05 and (s.running or s.waiting):
            s.finish(rng.choice([*s.running, *s.waiting]))  # an abort
        out = s.schedule()
        for x in out.scheduled:
            r, start = x.request, x.request.num_computed_tokens
            toks = r.all_token_ids
            for p in range(start):
                assert written[blocks.slot(r.request_id, p)] == tuple(toks[: p + 1])
            for p in range(start, start + x.num_new_tokens):
                b = blocks.tables[r.request_id][p // 2]
                assert blocks.refcounts[b] == 1 and b not in blocks.hash_of
                written[blocks.slot(r.request_id, p)] = tuple(toks[: p + 1])
        for x in out.scheduled:
            r, samples = x.request, x.samples
            r.num_computed_tokens += x.num_new_tokens
            s.computed(r)
            if samples:
                r.output_token_ids.append(rng.randint(1, 3))
                if len(r.output_token_ids) == r.params.max_tokens:
                    s.finish(r)
        s.check_integrity()
    assert s.prefix_cache_hits > 100 and s.num_preemptions > 5
