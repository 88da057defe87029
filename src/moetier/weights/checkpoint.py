"""Reads safetensors checkpoints by offset: headers, single tensors, and byte ranges.

Owns file handles and header validation; never loads a whole file into RAM.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.errors import CheckpointError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: file, absolute byte offset, dtype and shape."""

    name: str
    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: file is too short to be safetensors ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise CheckpointError(
                    f"{path}: header length {header_len} exceeds file size {size}; the file is "
                    f"truncated or not safetensors — re-download or re-save it"
                )
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc})") from exc
    base = 8 + header_len
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        if base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name} ends at byte {base + end} but the file has {size} bytes; "
                f"the file is truncated — re-download or re-save it"
            )
        out[name] = TensorInfo(
            name, path, base + start, end - start, _DTYPES[meta["dtype"]], tuple(meta["shape"])
        )
    return out


class Checkpoint:
    """A model directory's safetensors tensors, indexed by name, read on demand by offset."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        for path in self._shard_files():
            self.tensors.update(_read_header(path))

    def _shard_files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        single = self.model_dir / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.model_dir / f).exists()]
            if missing:
                raise CheckpointError(
                    f"{self.model_dir}: shard(s) listed in model.safetensors.index.json are "
                    f"missing: "
                    f"{', '.join(missing)} — download them or fix the index"
                )
            return [self.model_dir / f for f in files]
        if single.exists():
            return [single]
        found = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if found:
            return [self.model_dir / f for f in found]
        raise CheckpointError(
            f"{self.model_dir}: no model.safetensors, model.safetensors.index.json or "
            f"*.safetensors "
            f"file; moetier reads safetensors checkpoints only"
        )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found") from None

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def read_bytes_into(self, path: Path, offset: int, out: torch.Tensor) -> None:
        """Fill the uint8 tensor `out` (contiguous, CPU) with bytes from `path` at `offset`."""
        view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
        fd, done, total = self._fd(path), 0, out.numel()
        while done < total:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")
            done += n

    def read(self, name: str, row: int | None = None) -> torch.Tensor:
        """Read tensor `name` (or one slice `row` of its first dimension) into a new CPU tensor."""
        info = self.info(name)
        shape, offset, nbytes = info.shape, info.offset, info.nbytes
        if row is not None:
            nbytes //= shape[0]
            offset += row * nbytes
            shape = shape[1:]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.read_bytes_into(info.file, offset, buf)
        return buf.view(info.dtype).reshape(shape)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
