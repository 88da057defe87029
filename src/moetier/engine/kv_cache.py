"""Paged KV cache: per-layer K/V block pools over the block manager (block_manager.py).

Owns KV memory (the pool tensors, allocated at start-up, the storage format, and the step's
addressing through the block tables); knows nothing of scheduling policy or sampling. The
scheduler decides who gets blocks; attention writes and reads the pools through the per-step
`KVBatch` built by the model runner.

Storage formats (`KV_FORMATS`, `--kv-cache-dtype`): the model dtype (`auto`, exact), another
float dtype (cast on write and read), or int8 / fp8 (e4m3) with one float32 absmax scale per
(token, head), quantized when written and dequantized when read. Per-token scales, not
per-(block, head): a block fills one token at a time, and a block-wide scale would force
re-quantizing its earlier tokens whenever a larger value arrives (rounding twice); a token's
scale never changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetier.config import KV_CACHE_DTYPES, CacheConfig, format_bytes, parse_budget
from moetier.device_memory import allocate, free_memory
from moetier.engine.block_manager import BlockManager
from moetier.errors import ConfigError, DeviceMemoryError
from moetier.layers.context import KVBatch

log = logging.getLogger(__name__)

# Legend: NB blocks, BS tokens per block, S = NB * BS token slots, Hkv KV heads, d head dim,
# B decode sequences in a step, L history length (padded to the longest in the step).

INT8_MAX = 127
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MIN_CAPABILITY = (8, 9)  # CUDA compute capability with e4m3 hardware (Ada, Hopper and newer)
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVFormat:
    """How K/V are stored: `storage` dtype; `scaled`: int8 or fp8 values with a float32 scale
    per (token, head) beside them."""

    name: str
    storage: torch.dtype
    scaled: bool = False

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., d] -> (values [..., d] in `storage`, float32 scales [...]); scaled only."""
        assert self.scaled, f"KV format {self.name} stores values as they are"
        return quantize_fp8(x) if self.storage == FP8 else quantize_int8(x)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        assert self.scaled, f"KV format {self.name} stores values as they are"
        if self.storage == FP8:
            return dequantize_fp8(q, scale, dtype)
        return dequantize_int8(q, scale, dtype)

    def bytes_per_vector(self, dim: int) -> int:
        """Bytes of one head's vector of `dim` channels for one token (its scale included)."""
        size = torch.empty((), dtype=self.storage).element_size()
        return dim * size + (SCALE_DTYPE.itemsize if self.scaled else 0)


KV_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", torch.bfloat16),
    "fp16": KVFormat("fp16", torch.float16),
    "fp32": KVFormat("fp32", torch.float32),
    "int8": KVFormat("int8", torch.int8, scaled=True),
    "fp8": KVFormat("fp8", FP8, scaled=True),
}
_FLOAT_NAMES = {f.storage: f.name for f in KV_FORMATS.values() if not f.scaled}
assert ("auto", *KV_FORMATS) == KV_CACHE_DTYPES, "config.KV_CACHE_DTYPES names these formats"


def resolve_kv_format(name: str, model_dtype: torch.dtype, device: torch.device) -> KVFormat:
    """The effective format: `auto` is the model dtype (today's exact cache, never fp8). Every
    format here is plain tensor ops, so every family (all attend through this cache) can use
    it; a format a device cannot hold raises here (fp8 on CUDA below compute capability 8.9),
    never falls back silently."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if name == "auto":
        if model_dtype not in _FLOAT_NAMES:
            raise ConfigError(f"no KV cache format for model dtype {model_dtype}")
        return KV_FORMATS[_FLOAT_NAMES[model_dtype]]
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"KV cache dtype {name!r} is not supported on device {device}")
    if name == "fp8" and device.type == "cuda":
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap < FP8_MIN_CAPABILITY:
            raise ConfigError(
                f"KV cache dtype 'fp8' (float8 e4m3) needs a CUDA device of compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer; {device} is "
                f"{'.'.join(map(str, cap))}. Use --kv-cache-dtype int8 (the same bytes per "
                f"token) or bf16"
            )
    return KV_FORMATS[name]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (int8 [..., d], float32 scales [...]): symmetric absmax over the last dim,
    scale = absmax / 127 (1 for an all-zero vector), values round(x / scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., d] and float32 scales [...] -> [..., d] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (float8_e4m3fn [..., d], float32 scales [...]): absmax over the last dim,
    scale = absmax / 448 (1 for an all-zero vector), values x / scale in float32, clamped to
    +-448 (a quotient can round a step above it; e4m3fn has no infinity, and the clamp keeps
    an overflowing cast from depending on the device), then torch's cast (round to nearest
    even)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn [..., d] and float32 scales [...] -> [..., d] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's per-token K/V: (heads, channels) of keys and of values (None: keys
    only, MLA's latent, whose first channels are the values)."""

    k: tuple[int, int]
    v: tuple[int, int] | None


def kv_layout(model: torch.nn.Module) -> dict[int, LayerKV]:
    """Layer -> the K/V shapes its attention writes, read from the modules (no forward)."""
    from moetier.layers.attention import Attention
    from moetier.layers.compressed_attention import CompressedAttention
    from moetier.layers.mla import MLAttention

    out: dict[int, LayerKV] = {}
    for m in model.modules():
        if isinstance(m, Attention):
            spec = LayerKV((m.n_kv, m.head_dim), (m.n_kv, m.head_dim))
        elif isinstance(m, MLAttention):
            # the latent and the rope key as one shared head, or K/V expanded per head
            if m.latent_cache:
                spec = LayerKV((1, m.kv_lora_rank + m.dr), None)
            else:
                spec = LayerKV((m.n_heads, m.dq), (m.n_heads, m.dv))
        elif isinstance(m, CompressedAttention):
            # DeepSeek-V4: one row per token (its key and compressor projections), keys only
            spec = LayerKV(m.kv_keys_shape, None)
        else:
            continue
        assert m.layer not in out, f"two attention modules write KV layer {m.layer}"
        out[int(m.layer)] = spec
    return out


def kv_bytes_per_token(layout: dict[int, LayerKV], fmt: KVFormat) -> int:
    """K+V bytes one token takes over all attention layers, as stored (int8/fp8 scales
    included)."""
    total = 0
    for spec in layout.values():
        for heads, dim in (spec.k, spec.v) if spec.v is not None else (spec.k,):
            total += heads * fmt.bytes_per_vector(dim)
    return total


class PagedKVCache:
    """K and V block pools per layer in one storage format, allocated when built."""

    def __init__(
        self,
        blocks: BlockManager,
        device: torch.device,
        layout: dict[int, LayerKV],
        fmt: KVFormat,
    ) -> None:
        self.blocks = blocks
        self.device = device
        self.layout = layout
        self.format = fmt
        n = blocks.num_blocks * blocks.block_size
        # One scratch slot past the blocks, in no block table: the pad tokens of a CUDA-graph
        # prefill (engine/prefill_graphs.py) write their K/V here, so a real token's K/V is
        # never overwritten and no block is taken from the scheduler. Not in `bytes()`.
        self.pad_slot = n
        # Zeros, not empty: padded decode rows read slot 0 with weight 0, and 0 * NaN is NaN.
        self._k: dict[int, torch.Tensor] = {}  # layer -> [S + 1, Hkv, dk]
        self._v: dict[int, torch.Tensor] = {}  # layer -> [S + 1, Hkv, dv]
        self._k_scale: dict[int, torch.Tensor] = {}  # layer -> [S + 1, Hkv] float32 (int8, fp8)
        self._v_scale: dict[int, torch.Tensor] = {}
        rows = n + 1  # the blocks' slots, then the pad slot
        for layer, spec in layout.items():
            self._k[layer] = torch.zeros(rows, *spec.k, dtype=fmt.storage, device=device)
            if fmt.scaled:
                self._k_scale[layer] = torch.zeros(
                    rows, spec.k[0], dtype=SCALE_DTYPE, device=device
                )
            if spec.v is not None:
                self._v[layer] = torch.zeros(rows, *spec.v, dtype=fmt.storage, device=device)
                if fmt.scaled:
                    self._v_scale[layer] = torch.zeros(
                        rows, spec.v[0], dtype=SCALE_DTYPE, device=device
                    )

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layout, self.format)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor
    ) -> None:
        """Store k [T, Hkv, dk], v [T, Hkv, dv] (None: keys only, MLA's latent) at slots [T]."""
        assert layer in self._k, f"KV layer {layer} has no pool (not in the model's layout)"
        self._store(self._k[layer], self._k_scale.get(layer), k, slots)
        if v is not None:
            self._store(self._v[layer], self._v_scale.get(layer), v, slots)

    def _store(
        self, pool: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if scales is None:
            pool.index_copy_(0, slots, x.to(pool.dtype))
            return
        q, s = self.format.quantize(x)  # [T, Hkv, d], [T, Hkv]
        if q.dtype == FP8:  # no float8 index_copy_ on the CPU: copy the bytes
            pool, q = pool.view(torch.uint8), q.view(torch.uint8)
        pool.index_copy_(0, slots, q)
        scales.index_copy_(0, slots, s)

    def exact(self, dtype: torch.dtype) -> bool:
        """Values of `dtype` come back unchanged: stored as they are, in `dtype` itself."""
        return not self.format.scaled and self.format.storage == dtype

    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V (None when only keys are stored) at slots [...] -> [..., Hkv, d*] in
        `dtype`: gathered, then cast or dequantized."""
        return self._load(self._k[layer], self._k_scale.get(layer), slots, dtype), (
            self._load(self._v[layer], self._v_scale.get(layer), slots, dtype)
            if layer in self._v
            else None
        )

    def _load(
        self,
        pool: torch.Tensor,
        scales: torch.Tensor | None,
        slots: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        if scales is None:
            return pool[slots].to(dtype)  # the model dtype (auto): no copy beyond the gather
        return self.format.dequantize(pool[slots], scales[slots], dtype)

    def free(self, seq_id: int) -> int:
        return self.blocks.free(seq_id)

    def bytes(self) -> int:
        """Bytes of the blocks' slots (what the KV budget buys; the pad slot, one token, is
        left out)."""
        pools = (*self._k.values(), *self._v.values(), *self._k_scale.values())
        n = self.pad_slot
        return sum(t[:n].numel() * t.element_size() for t in (*pools, *self._v_scale.values()))

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


def build_kv_cache(
    cache: CacheConfig,
    max_num_seqs: int,
    max_model_len: int,
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
) -> PagedKVCache:
    """The block manager and the pools, allocated now (block count from the byte budget): a
    cache that cannot fit is a start-up DeviceMemoryError, never a failed first request."""
    if cache.block_size < 1:
        raise ConfigError(f"KV block size must be at least 1, got {cache.block_size}")
    fmt = resolve_kv_format(cache.kv_cache_dtype, dtype, device)
    layout = kv_layout(model)
    per_token = kv_bytes_per_token(layout, fmt)
    num_blocks = cache.num_blocks
    if num_blocks is None:
        default = 4 << 30 if device.type == "cuda" else 512 << 20
        budget = default if cache.kv_cache_bytes is None else None
        if budget is None:
            budget = parse_budget(cache.kv_cache_bytes, default, "kv_cache_bytes")
        num_blocks = default_num_blocks(
            per_token, cache.block_size, max_model_len, max_num_seqs, budget
        )
    if num_blocks < 1:
        raise ConfigError(f"KV cache needs at least one block, got num_blocks={num_blocks}")
    asked = num_blocks * cache.block_size * per_token
    what = (
        f"the KV cache ({num_blocks} blocks of {cache.block_size} tokens, {per_token} B/token "
        f"as {fmt.name})"
    )
    fix = _kv_fix(cache, fmt, max_num_seqs, max_model_len)
    room = available_memory(device)
    if room is not None and asked > room:
        raise DeviceMemoryError(
            f"device {device} cannot hold {what}: needs {format_bytes(asked)} ({asked} B), "
            f"{format_bytes(room)} ({room} B) available. {fix(None)}"
        )
    blocks = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
    kv = allocate(
        device, lambda: PagedKVCache(blocks, device, layout, fmt), what, lambda: asked, fix
    )
    log.info(
        "KV cache: %d blocks x %d tokens in %s%s, %d B/token, %s allocated",
        num_blocks,
        cache.block_size,
        fmt.name,
        " (float32 scale per token and head)" if fmt.scaled else "",
        per_token,
        format_bytes(kv.bytes()),
    )
    return kv


def available_memory(device: torch.device) -> int | None:
    """Bytes new tensors can take on `device`: CUDA's free memory plus what torch's allocator
    holds unused; on the CPU the host's MemAvailable (Linux); None when unknown."""
    if device.type == "cuda":
        free_total = free_memory(device)
        assert free_total is not None
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free_total[0] + int(cached)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _kv_fix(
    cache: CacheConfig, fmt: KVFormat, max_num_seqs: int, max_model_len: int
) -> Callable[[tuple[int, int] | None], str]:
    """What to lower when the KV pools do not fit."""
    if cache.num_blocks is not None:
        text = f"Lower --num-kv-blocks (LLM(num_kv_blocks=...)), now {cache.num_blocks}"
    else:
        text = (
            f"Lower --max-num-seqs (now {max_num_seqs}) or --max-model-len (now "
            f"{max_model_len}), which size the KV cache, or set a smaller --num-kv-blocks"
        )
    if not fmt.scaled:
        text += (
            ", or store it in int8 or fp8 (--kv-cache-dtype int8|fp8, about half the bytes of bf16)"
        )
    return lambda _free_total: text + "."
