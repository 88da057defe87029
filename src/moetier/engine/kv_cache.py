"""KV cache: per-sequence, per-layer contiguous buffers that grow by doubling.

Owns K/V memory of running sequences; knows nothing of scheduling or sampling. (A paged block
allocator replaces this behind the same `append` interface.)
"""

from __future__ import annotations

import torch


class KVCache:
    """k/v history per (layer, sequence); `append` returns views of the whole history."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, initial_capacity: int = 64
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.initial = initial_capacity
        self._k: dict[tuple[int, int], torch.Tensor] = {}
        self._v: dict[tuple[int, int], torch.Tensor] = {}
        self._len: dict[tuple[int, int], int] = {}

    def append(
        self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k [q, Hkv, dk], v [q, Hkv, dv] -> full history views [L, Hkv, d*]."""
        key = (layer, seq_id)
        n = self._len.get(key, 0)
        need = n + k.shape[0]
        buf_k = self._k.get(key)
        if buf_k is None or buf_k.shape[0] < need:
            cap = max(self.initial, need, 2 * (buf_k.shape[0] if buf_k is not None else 0))
            self._grow(key, cap, k, v, n)
        self._k[key][n:need] = k
        self._v[key][n:need] = v
        self._len[key] = need
        return self._k[key][:need], self._v[key][:need]

    def _grow(
        self, key: tuple[int, int], cap: int, k: torch.Tensor, v: torch.Tensor, n: int
    ) -> None:
        new_k = torch.empty(cap, *k.shape[1:], device=self.device, dtype=k.dtype)
        new_v = torch.empty(cap, *v.shape[1:], device=self.device, dtype=v.dtype)
        if n:
            new_k[:n] = self._k[key][:n]
            new_v[:n] = self._v[key][:n]
        self._k[key], self._v[key] = new_k, new_v

    def free(self, seq_id: int) -> None:
        for key in [key for key in self._len if key[1] == seq_id]:
            del self._k[key], self._v[key], self._len[key]

    def num_sequences(self) -> int:
        return len({key[1] for key in self._len})

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))
