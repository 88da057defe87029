"""Paged KV cache: exact block ids from the block manager, slots, and device-side addressing."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.block_manager import BlockManager
from moetier.engine.kv_cache import (
    KV_FORMATS,
    LayerKV,
    PagedKVCache,
    decode_width,
    default_num_blocks,
)

CPU = torch.device("cpu")


def _cache(m: BlockManager, fmt: str = "fp32") -> PagedKVCache:
    """A one-layer cache of 1 KV head, 3 channels."""
    return PagedKVCache(m, CPU, {0: LayerKV((1, 3), (1, 3))}, KV_FORMATS[fmt])


def test_blocks_lowest_first_and_freed_blocks_reused_first() -> None:
    m = BlockManager(num_blocks=6, block_size=4)
    assert m.allocate(0, 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert m.allocate(1, 4) == [2]
    assert m.allocate(0, 8) == []  # still fits in its 2 blocks
    assert m.allocate(0, 9) == [3]
    assert m.tables == {0: [0, 1, 3], 1: [2]}
    assert (m.num_used, m.num_free) == (4, 2)
    assert m.free(0) == 3
    assert m.allocate(2, 12) == [0, 1, 3]  # LIFO: the freed table comes back in order
    assert m.free(7) == 0
    m.check_integrity()


def test_slots_and_capacity() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(0, 4)
    m.allocate(1, 6)  # blocks 1, 2
    assert [m.slot(1, p) for p in range(6)] == [4, 5, 6, 7, 8, 9]
    assert m.can_allocate(1, 12) and not m.can_allocate(1, 13)
    with pytest.raises(MemoryError, match="needs 2 more blocks, 1 free"):
        m.allocate(1, 13)
    m.check_integrity()


def test_integrity_catches_a_double_owned_block() -> None:
    m = BlockManager(num_blocks=3, block_size=2)
    m.allocate(0, 2)
    m.tables[1] = [0]
    with pytest.raises(AssertionError):
        m.check_integrity()


def test_build_batch_addresses_history_through_block_tables() -> None:
    m = BlockManager(num_blocks=8, block_size=2)
    cache = _cache(m)
    m.allocate(5, 3)  # blocks 0, 1
    m.allocate(6, 4)  # blocks 2, 3
    m.allocate(5, 4)  # seq 5 decodes position 3: no new block
    m.allocate(7, 2)  # block 4: a 2-token prefill
    # seq 5 decodes its 4th token, seq 7 prefills 2, seq 6 decodes its 4th (past 3)
    b = cache.build_batch([(5, 3, 1), (7, 0, 2), (6, 3, 1)], total=4)
    assert b.slot_mapping.tolist() == [3, 8, 9, 7]
    assert b.decode_spans == (0, 2)
    assert b.decode_rows is not None and b.decode_rows.tolist() == [0, 3]
    assert b.decode_slots is not None and b.decode_mask is not None
    # padded to decode_width (4 blocks = 8 slots), the width graph replays use
    assert b.decode_slots.tolist() == [[0, 1, 2, 3, 0, 0, 0, 0], [4, 5, 6, 7, 0, 0, 0, 0]]
    assert b.decode_mask.shape == (2, 1, 1, 8)
    assert b.decode_mask[:, 0, 0].tolist() == [[True] * 4 + [False] * 4] * 2
    assert b.span_slots is not None and b.span_slots[1].tolist() == [8, 9]


def test_decode_padding_is_masked_and_points_at_slot_zero() -> None:
    m = BlockManager(num_blocks=4, block_size=2)
    cache = _cache(m)
    m.allocate(0, 1)
    m.allocate(1, 3)
    b = cache.build_batch([(0, 0, 1), (1, 2, 1)], total=2)
    assert b.decode_slots is not None and b.decode_mask is not None
    assert b.decode_slots.tolist() == [[0] * 8, [2, 3, 4, 0, 0, 0, 0, 0]]
    assert b.decode_mask[:, 0, 0].tolist() == [
        [True] + [False] * 7,
        [True] * 3 + [False] * 5,
    ]


def test_decode_width_is_a_power_of_two_of_at_least_four_blocks() -> None:
    assert [decode_width(n) for n in (0, 1, 4, 5, 8, 9, 100)] == [4, 4, 4, 8, 8, 16, 128]


def test_write_stores_at_slots() -> None:
    m = BlockManager(num_blocks=2, block_size=2)
    cache = _cache(m)
    k = torch.arange(6.0).view(2, 1, 3)  # [T=2, Hkv=1, d=3]
    cache.write(0, k, -k, torch.tensor([3, 1]))
    kp, vp = cache.read(0, torch.arange(4), torch.float32)
    assert vp is not None
    assert kp.shape == (4, 1, 3) and vp.shape == (4, 1, 3)
    assert kp[3].tolist() == [[0.0, 1.0, 2.0]] and kp[1].tolist() == [[3.0, 4.0, 5.0]]
    assert vp[3].tolist() == [[-0.0, -1.0, -2.0]]
    assert kp[0].abs().sum() == 0  # untouched slots are zeros, never NaN


def test_default_num_blocks() -> None:
    # 100 B/token, 4 tokens/block: 400 B/block; 16-token sequences need 4 blocks
    assert default_num_blocks(100, 4, 16, 8, budget_bytes=4000) == 10
    assert default_num_blocks(100, 4, 16, 2, budget_bytes=1 << 30) == 8  # capped by need
    assert default_num_blocks(100, 4, 16, 8, budget_bytes=0) == 4  # one full sequence
