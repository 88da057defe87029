"""Streaming writer of sharded safetensors checkpoints (`model-0000i-of-0000n` + index).

Writes tensor by tensor straight to disk, so a tensor listed many times (an upcycled expert)
costs its bytes on disk but no extra RAM, and a `LazyTensor` (a perturbed expert) is made only
when its bytes are written. Deterministic: same tensors in, same bytes out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made on demand: `make()` must return exactly `shape` and `dtype`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def materialize(self) -> torch.Tensor:
        t = self.make()
        assert tuple(t.shape) == self.shape and t.dtype == self.dtype, "LazyTensor made wrong"
        return t


Entry = tuple[str, "torch.Tensor | LazyTensor"]


def tensor_nbytes(t: torch.Tensor | LazyTensor) -> int:
    numel = 1
    for dim in t.shape:
        numel *= int(dim)
    return numel * torch.empty(0, dtype=t.dtype).element_size()


def plan_shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Greedy split in order; a shard exceeds max_shard_bytes only to hold one huge tensor."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = tensor_nbytes(entry[1])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _header(entries: Sequence[Entry]) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in entries:
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code here")
        end = offset + tensor_nbytes(t)
        meta[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _tensor_bytes(t: torch.Tensor | LazyTensor) -> memoryview:
    if isinstance(t, LazyTensor):
        t = t.materialize()
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def write_shard(path: Path, entries: Sequence[Entry], bar: tqdm | None = None) -> None:
    with open(path, "wb") as f:
        f.write(_header(entries))
        for _, t in entries:
            f.write(_tensor_bytes(t))
            if bar is not None:
                bar.update(tensor_nbytes(t))


def write_sharded(
    directory: Path, entries: Sequence[Entry], max_shard_bytes: int, progress: bool = True
) -> list[Path]:
    """Write entries (name, CPU tensor) as shards plus the index; returns the shard paths."""
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    shards = plan_shards(entries, max_shard_bytes)
    total = sum(tensor_nbytes(t) for _, t in entries)
    weight_map: dict[str, str] = {}
    paths: list[Path] = []
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="writing checkpoint", disable=not progress
    ) as bar:
        for i, shard in enumerate(shards, start=1):
            path = directory / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_shard(path, shard, bar)
            paths.append(path)
            weight_map.update({name: path.name for name, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths
