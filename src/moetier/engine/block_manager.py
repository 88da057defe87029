"""KV block bookkeeping: block tables per sequence, refcounts, the free list and the prefix cache.

Pure Python; owns which block belongs to which sequence and which full blocks are cached by
content, never the K/V tensors (kv_cache.py) nor who gets blocks (the scheduler decides).

Automatic prefix caching (vLLM's design): once a full block's tokens are computed, the block is
addressed by a hash of its tokens chained with the hash of the blocks before it, so equal
blocks after different prefixes never match. A new (or recomputed) sequence starts its table
with the longest chain of cached blocks matching its tokens and computes only the rest. Blocks
are refcounted: a sequence that ends drops its references; a hashed block left with none stays
cached (evictable, least recently released first, a sequence's tail before its head) until an
allocation needs it, after the never-hashed free blocks are used up. Only full, computed blocks
are shared, and a sequence writes only at positions past its progress counter, so a shared block
is never written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def block_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The content address of a full block: SHA-256 of the parent's hash and the block's token
    ids (a collision would serve another prompt's K/V: not Python's `hash`, whose collisions
    can be crafted)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Fixed-size blocks, one block table (list of block ids) per sequence.

    Never-hashed blocks are handed out lowest id first and a freed sequence's blocks are reused
    first (LIFO), so tests can assert exact ids. `prefix_caching` off: blocks are never hashed,
    the cached list stays empty and this is a plain free list.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> lowest
        self.tables: dict[int, list[int]] = {}
        self.refcounts: list[int] = [0] * num_blocks  # sequences whose table holds the block
        self.hash_of: dict[int, BlockHash] = {}  # block -> content hash (full, computed)
        self.cached: dict[BlockHash, int] = {}  # content hash -> block (the inverse)
        # Hashed blocks no sequence holds, least recently released first (evicted first).
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # seq -> hashes of its leading full computed blocks (the chain it may still extend).
        self.chains: dict[int, list[BlockHash]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-hashed free ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence (a shared block counts once)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Cached blocks no sequence holds (kept for a later prefix hit, evictable)."""
        return len(self.evictable)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` (block ids, in order); no
        side effects. The last token is always left to compute, so the step that computes it
        has logits to sample from."""
        if not self.prefix_caching:
            return []
        bs, parent, out = self.block_size, b"", []
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.cached.get(parent)
            if block is None:
                break
            out.append(block)
        return out

    def can_allocate(self, seq_id: int, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """True when `seq_id` can hold `num_tokens` tokens after allocating what it lacks;
        `prefix`: cached blocks (from `match_prefix`) it would start its table with."""
        have = len(self.tables.get(seq_id, ())) + len(prefix)
        taken = sum(1 for b in prefix if b in self.evictable)  # they leave the evictable list
        return self.blocks_for(num_tokens) - have <= self.num_free - taken

    def allocate(self, seq_id: int, num_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Grow `seq_id`'s table to cover `num_tokens` tokens; return the newly taken block ids
        (not the `prefix` blocks, which a new table starts with and which are shared)."""
        if prefix:
            assert seq_id not in self.tables, "a prefix starts a new block table"
            if not self.can_allocate(seq_id, num_tokens, prefix):
                raise MemoryError(f"KV cache: sequence {seq_id} does not fit with its prefix")
            for b in prefix:
                self.refcounts[b] += 1
                self.evictable.pop(b, None)
            self.tables[seq_id] = list(prefix)
            self.chains[seq_id] = [self.hash_of[b] for b in prefix]
        table = self.tables.setdefault(seq_id, [])
        self.chains.setdefault(seq_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free:
            raise MemoryError(
                f"KV cache: sequence {seq_id} needs {need} more blocks, {self.num_free} free"
            )
        new = [self._take() for _ in range(max(need, 0))]
        table.extend(new)
        return new

    def _take(self) -> int:
        """A block for a table: a never-hashed free one, else the least recently released
        cached one (its hash forgotten)."""
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
        self.refcounts[block] = 1
        return block

    def cache_full_blocks(
        self, seq_id: int, num_computed: int, prompt: Sequence[int], output: Sequence[int]
    ) -> None:
        """`seq_id` has computed K/V for its first `num_computed` tokens (prompt then output
        ids): hash its blocks that became full, so later sequences can share them. A block
        whose content another block already caches stays unhashed (freed, not cached)."""
        chain = self.chains.get(seq_id)
        if not self.prefix_caching or chain is None:
            return
        bs, table = self.block_size, self.tables[seq_id]
        for i in range(len(chain), num_computed // bs):
            lo, hi, n = i * bs, (i + 1) * bs, len(prompt)
            tokens = [*prompt[lo:hi], *output[max(lo - n, 0) : max(hi - n, 0)]]
            h = block_hash(chain[-1] if chain else b"", tokens)
            chain.append(h)
            block = table[i]
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h

    def free(self, seq_id: int) -> int:
        """Drop `seq_id`'s references; blocks no one holds go back to the free list, or to the
        cached (evictable) list when hashed. The number of blocks its table held."""
        table = self.tables.pop(seq_id, [])
        self.chains.pop(seq_id, None)
        for b in reversed(table):  # the tail first: evicted before the head it extends
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.free_blocks.append(b)
        return len(table)

    def reset_prefix_cache(self) -> int:
        """Forget every block's hash (after anything that changes what K/V a token gets, e.g.
        new weights or a routing override): cached blocks become free blocks, held ones are
        freed, not cached, when released. The number of cached blocks dropped."""
        dropped = len(self.evictable)
        self.free_blocks.extend(reversed(self.evictable))  # least recently released: last out
        self.evictable.clear()
        self.hash_of.clear()
        self.cached.clear()
        return dropped

    def slot(self, seq_id: int, position: int) -> int:
        """The flat token slot (block * BS + offset) holding `position` of `seq_id`."""
        block = self.tables[seq_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def check_integrity(self) -> None:
        """Refcounts equal table membership; every block is held, free or evictable, exactly
        once; the hash maps are inverse; only hashed blocks are shared; a table's blocks past
        its chain are unhashed (it alone writes them)."""
        counts = [0] * self.num_blocks
        for t in self.tables.values():
            for b in t:
                counts[b] += 1
        assert counts == self.refcounts, "refcounts differ from the block tables"
        free, evictable = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks), "a block is twice in the free list"
        held = {b for b, n in enumerate(counts) if n}
        assert not (free & evictable) and not (held & (free | evictable)), "a held block is free"
        assert len(held) + len(free) + len(evictable) == self.num_blocks, "blocks leaked"
        assert all(b in self.hash_of for b in evictable), "an unhashed block is in the cache"
        assert not free & set(self.hash_of), "a hashed block is in the free list"
        assert {b: h for h, b in self.cached.items()} == self.hash_of, "hash maps disagree"
        assert all(n <= 1 or b in self.hash_of for b, n in enumerate(counts)), (
            "a block is shared before it is full and hashed"
        )
        assert self.chains.keys() == self.tables.keys(), "chains and tables differ"
        for seq, t in self.tables.items():
            chain = self.chains[seq]
            assert len(chain) <= len(t), "a chain is longer than its table"
            for i, b in enumerate(t):
                h = self.hash_of.get(b)
                assert h is None or (i < len(chain) and h == chain[i]), "a table's hash is wrong"
