"""Paged KV cache: per-layer K/V block pools over the block manager (block_manager.py).

Owns KV memory (the pool tensors and the step's addressing through the block tables); knows
nothing of scheduling policy or sampling. The scheduler decides who gets blocks; attention reads
and writes the pools through the per-step `KVBatch` built by the model runner.
"""

from __future__ import annotations

import torch

from moetier.config import CacheConfig, parse_budget
from moetier.engine.block_manager import BlockManager
from moetier.errors import ConfigError
from moetier.layers.context import KVBatch

# Legend: NB blocks, BS tokens per block, S = NB * BS token slots, Hkv KV heads, d head dim,
# B decode sequences in a step, L history length (padded to the longest in the step).


class PagedKVCache:
    """K and V block pools per layer, allocated on a layer's first write with its K/V shapes."""

    def __init__(self, blocks: BlockManager, device: torch.device) -> None:
        self.blocks = blocks
        self.device = device
        self._k: dict[int, torch.Tensor] = {}  # layer -> [S, Hkv, dk]
        self._v: dict[int, torch.Tensor] = {}  # layer -> [S, Hkv, dv]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store k [T, Hkv, dk], v [T, Hkv, dv] (None: keys only, MLA's latent) at slots [T];
        return the layer's pools (None for values not stored)."""
        if layer not in self._k:
            # Zeros, not empty: padded decode rows read slot 0 with weight 0, and 0 * NaN is NaN.
            n = self.blocks.num_blocks * self.blocks.block_size
            self._k[layer] = torch.zeros(n, *k.shape[1:], dtype=k.dtype, device=self.device)
            if v is not None:
                self._v[layer] = torch.zeros(n, *v.shape[1:], dtype=v.dtype, device=self.device)
        kp, vp = self._k[layer], self._v.get(layer)
        kp.index_copy_(0, slots, k.to(kp.dtype))
        if vp is not None and v is not None:
            vp.index_copy_(0, slots, v.to(vp.dtype))
        return kp, vp

    def free(self, seq_id: int) -> int:
        return self.blocks.free(seq_id)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    def build_batch(self, spans: list[tuple[int, int, int]], total: int) -> KVBatch:
        """spans: (seq_id, past, num_new) in flattened order covering `total` tokens."""
        bs = self.blocks.block_size
        slot_mapping: list[int] = []
        dec_rows: list[int] = []
        dec_idx: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        span_slots: dict[int, torch.Tensor] = {}
        row = 0
        for i, (seq, past, n) in enumerate(spans):
            table = self.blocks.tables[seq]
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(past, past + n))
            if n == 1:
                dec_idx.append(i)
                dec_rows.append(row)
                dec_tables.append(table)
                dec_lens.append(past + 1)
            else:
                span_slots[i] = self._slots_of(table, past + n)
            row += n
        assert row == total
        out = KVBatch(self._tensor(slot_mapping), span_slots=span_slots)
        if dec_rows:
            out.decode_rows = self._tensor(dec_rows)
            out.decode_spans = tuple(dec_idx)
            out.decode_slots, out.decode_mask = self._decode_slots(dec_tables, dec_lens)
        return out

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _slots_of(self, table: list[int], length: int) -> torch.Tensor:
        bs = self.blocks.block_size
        blocks = self._tensor(table[: self.blocks.blocks_for(length)])  # [nb]
        offs = torch.arange(bs, device=self.device)
        return (blocks[:, None] * bs + offs).flatten()[:length]  # [L]

    def _decode_slots(
        self, tables: list[list[int]], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables -> history slots [B, L] and mask [B, 1, 1, L], computed on the device."""
        bs = self.blocks.block_size
        # Padded to the width CUDA-graph replays use (engine/graphs.py), so eager and replayed
        # decode attention run the same shapes and give the same bits.
        width = decode_width(self.blocks.blocks_for(max(lengths)))
        padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        table = torch.tensor(padded, dtype=torch.long).to(self.device, non_blocking=True)
        offs = torch.arange(bs, device=self.device)
        slots = (table[:, :, None] * bs + offs).flatten(1)  # [B, L]
        lens = self._tensor(lengths)  # [B]
        mask = torch.arange(width * bs, device=self.device)[None, :] < lens[:, None]  # [B, L]
        slots = slots.masked_fill(~mask, 0)
        return slots, mask[:, None, None, :]


def decode_width(blocks: int) -> int:
    """Block-table width a decode batch is padded to: a power of two, at least 4 blocks (few
    distinct shapes, so few captured graphs; masked columns cost little at decode)."""
    return max(4, 1 << (max(blocks, 1) - 1).bit_length())


def default_num_blocks(
    per_token_bytes: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    budget_bytes: int,
) -> int:
    """Blocks that `budget_bytes` buys, at most what max_num_seqs full sequences need, and at
    least one full-length sequence."""
    per_block = max(per_token_bytes * block_size, 1)
    per_seq = -(-max_model_len // block_size)
    return max(min(budget_bytes // per_block, per_seq * max_num_seqs), per_seq)


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """K+V bytes one token takes over all attention layers (as attention writes them)."""
    from moetier.layers.attention import Attention
    from moetier.layers.mla import MLAttention

    elems = 0
    for m in model.modules():
        if isinstance(m, Attention):
            elems += 2 * m.n_kv * m.head_dim
        elif isinstance(m, MLAttention):
            # the latent and the rope key, or K/V expanded per head
            elems += m.kv_lora_rank + m.dr if m.latent_cache else m.n_heads * (m.dq + m.dv)
    return elems * torch.empty((), dtype=dtype).element_size()


def build_kv_cache(
    cache: CacheConfig,
    max_num_seqs: int,
    max_model_len: int,
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
) -> PagedKVCache:
    """The block manager and pools for `cache` settings (block count from the byte budget)."""
    if cache.block_size < 1:
        raise ConfigError(f"KV block size must be at least 1, got {cache.block_size}")
    num_blocks = cache.num_blocks
    if num_blocks is None:
        default = 4 << 30 if device.type == "cuda" else 512 << 20
        budget = default if cache.kv_cache_bytes is None else None
        if budget is None:
            budget = parse_budget(cache.kv_cache_bytes, default, "kv_cache_bytes")
        num_blocks = default_num_blocks(
            kv_bytes_per_token(model, dtype), cache.block_size, max_model_len, max_num_seqs, budget
        )
    if num_blocks < 1:
        raise ConfigError(f"KV cache needs at least one block, got num_blocks={num_blocks}")
    blocks = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
    return PagedKVCache(blocks, device)
