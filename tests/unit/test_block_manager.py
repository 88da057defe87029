"""Block manager with prefix caching: exact shared block ids, refcounts, LRU eviction, chaining."""

from __future__ import annotations

import pytest

from moetier.engine.block_manager import BlockManager, block_hash

P = list(range(1, 11))  # a 10-token prompt: blocks [1..4], [5..8] full, [9, 10] partial (BS 4)


def _run(m: BlockManager, seq: int, prompt: list[int]) -> list[int]:
    """Admit `seq` with its cached prefix, compute all its tokens; return its block table."""
    m.allocate(seq, len(prompt), m.match_prefix(prompt))
    m.cache_full_blocks(seq, len(prompt), prompt, [])
    return m.tables[seq]


def test_same_prefix_gets_the_same_blocks_and_refcounts_move_exactly() -> None:
    m = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    assert _run(m, 0, P) == [0, 1, 2]
    assert m.free(0) == 3
    # the two full blocks stay cached (tail first in eviction order); the partial one is freed
    assert list(m.evictable) == [1, 0] and m.free_blocks[-1] == 2
    assert (m.num_used, m.num_free, m.num_cached) == (0, 8, 2)
    b = [*P[:8], 50, 51, 52]
    assert m.match_prefix(b) == [0, 1]
    assert m.allocate(1, len(b), [0, 1]) == [2]  # only the rest is new: the freed block 2
    assert m.tables[1] == [0, 1, 2] and m.refcounts[:3] == [1, 1, 1] and m.num_cached == 0
    # 8 tokens = 2 full blocks, but the last token is always left to compute: one block hits
    assert m.match_prefix(P[:8]) == [0]
    assert m.allocate(2, 8, [0]) == [3]
    assert m.refcounts[:4] == [2, 1, 1, 1]
    m.check_integrity()
    # seq 2 computes its block 1 (same content as block 1): it stays unhashed, block 1 keeps it
    m.cache_full_blocks(2, 8, P[:8], [])
    assert 3 not in m.hash_of and m.cached[m.hash_of[1]] == 1
    m.check_integrity()
    m.free(2)
    assert m.refcounts[:4] == [1, 1, 1, 0] and m.free_blocks[-1] == 3
    m.free(1)
    assert m.refcounts[:4] == [0, 0, 0, 0] and list(m.evictable) == [1, 0]
    m.check_integrity()


def test_hash_chains_the_prefix() -> None:
    m = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    _run(m, 0, P)
    m.free(0)
    # the second block's tokens equal P's second block, after another first block: no hit
    assert m.match_prefix([9, 9, 9, 9, *P[4:8], 0]) == []
    assert block_hash(b"", P[4:8]) != block_hash(block_hash(b"", P[:4]), P[4:8])
    assert m.match_prefix([*P[:4], 7, 7, 7, 7, 0]) == [0]  # the first block still matches


def test_a_partial_block_is_never_shared_and_output_tokens_fill_blocks() -> None:
    m = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    prompt = P[:6]
    m.allocate(0, 6)
    m.cache_full_blocks(0, 6, prompt, [])
    assert list(m.hash_of) == [0]  # block 1 holds 2 of 4 tokens: not hashed
    assert m.match_prefix([*prompt, 7, 8, 9]) == [0]
    m.allocate(0, 8)  # two generated tokens complete block 1
    m.cache_full_blocks(0, 8, prompt, [70, 80])
    assert list(m.hash_of) == [0, 1]
    assert m.match_prefix([*prompt, 70, 80, 9]) == [0, 1]  # prompt + output ids
    assert m.match_prefix([*prompt, 70, 81, 9]) == [0]
    m.check_integrity()


def test_eviction_takes_free_blocks_first_then_least_recently_released() -> None:
    m = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    assert _run(m, 0, [1, 2, 3, 4]) == [0, 1]
    m.free(0)
    assert _run(m, 1, [5, 6, 7, 8]) == [2, 3]  # never-hashed blocks before cached ones
    m.free(1)
    assert list(m.evictable) == [1, 0, 3, 2] and m.free_blocks == []
    # a hit on block 0 takes it out of the list; its new block evicts the oldest (1)
    assert m.allocate(2, 3, m.match_prefix([1, 2, 9])) == [1]
    assert m.tables[2] == [0, 1] and list(m.evictable) == [3, 2]
    m.free(2)  # block 1 lost its hash: free; block 0 released again: most recent
    assert list(m.evictable) == [3, 2, 0] and m.free_blocks == [1]
    assert m.allocate(3, 8) == [1, 3, 2, 0]
    assert m.match_prefix([1, 2, 9]) == [] and m.num_cached == 0
    m.check_integrity()


def test_can_allocate_does_not_count_the_prefix_it_takes() -> None:
    m = BlockManager(num_blocks=3, block_size=2, prefix_caching=True)
    _run(m, 0, [1, 2, 3, 4])
    m.free(0)
    prefix = m.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert prefix == [0, 1] and m.num_free == 3
    assert m.can_allocate(1, 6, prefix)  # 1 more block: the free one
    assert not m.can_allocate(1, 7, prefix)  # 2 more: the cached ones are the prefix itself
    with pytest.raises(MemoryError):
        m.allocate(1, 7, prefix)
    assert 1 not in m.tables and list(m.evictable) == [1, 0]  # nothing changed
    m.check_integrity()


def test_without_prefix_caching_nothing_is_cached() -> None:
    m = BlockManager(num_blocks=4, block_size=2)
    assert _run(m, 0, [1, 2, 3, 4]) == [0, 1]
    assert m.hash_of == {} and m.match_prefix([1, 2, 3, 4, 5]) == []
    m.free(0)
    assert m.free_blocks == [3, 2, 1, 0] and m.num_cached == 0
    m.check_integrity()


def test_integrity_catches_a_shared_unhashed_block_and_a_wrong_refcount() -> None:
    m = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    m.allocate(0, 2)
    m.tables[1], m.chains[1] = [0], []
    m.refcounts[0] = 2
    with pytest.raises(AssertionError, match="shared before it is full"):
        m.check_integrity()
    m.refcounts[0] = 1
    with pytest.raises(AssertionError, match="refcounts"):
        m.check_integrity()


def test_reset_forgets_every_hash() -> None:
    m = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    _run(m, 0, [1, 2, 3, 4])
    m.free(0)
    _run(m, 1, [5, 6, 7, 8, 9])  # blocks 2, 3 and 1 (the oldest cached block evicted)
    assert list(m.evictable) == [0] and m.tables[1] == [2, 3, 1]
    assert m.reset_prefix_cache() == 1
    assert m.free_blocks == [0] and m.hash_of == {} and m.match_prefix([5, 6, 7, 8, 9]) == []
    m.check_integrity()
    m.free(1)  # held blocks that were hashed come back as free blocks
    assert m.free_blocks == [0, 1, 3, 2] and m.num_cached == 0
    m.check_integrity()
