"""Frozen settings of an engine, one dataclass per concern, and budget parsing.

Imports nothing else from the package except errors; holds no tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from moetier.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*$")

Budget = str | int | float | None

# --kv-cache-dtype choices; engine/kv_cache.py's KV_FORMATS holds one format per name but auto.
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8", "fp8")
KV_CACHE_DTYPE_HELP = (
    "how the KV cache stores K/V: auto (the model dtype, exact; default), bf16, fp16, fp32, "
    "int8 or fp8 (lossy: int8 or float8 e4m3 values with a float32 scale per token and head, "
    "about half of bf16's bytes, so more tokens fit; fp8 on CUDA needs compute capability 8.9+)"
)


def parse_budget(budget: Budget, total_bytes: int, what: str = "budget") -> int:
    """Turn "6GiB", "25%", 0.25-as-"25%" strings or a byte count into bytes.

    None or "all" means everything (`total_bytes`). A fraction must be given with "%".
    """
    if budget is None:
        return total_bytes
    if isinstance(budget, bool):
        raise ConfigError(
            f"{what}: expected bytes like '6GiB' or a fraction like '25%', got {budget!r}"
        )
    if isinstance(budget, int):
        if budget < 0:
            raise ConfigError(f"{what}: must not be negative, got {budget}")
        return budget
    if isinstance(budget, float):
        raise ConfigError(
            f"{what}: ambiguous float {budget!r}; write bytes ('6GiB', 1073741824) or a percentage "
            f"('25%')"
        )
    text = str(budget).strip()
    if text.lower() in ("all", "full", "100%"):
        return total_bytes
    match = _BUDGET_RE.match(text)
    if not match:
        raise ConfigError(
            f"{what}: cannot parse {budget!r}; write bytes ('6GiB', '512MB', '1073741824') or a "
            f"share ('25%': of routed-expert bytes for expert budgets, of the device for "
            f"gpu_memory)"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if number > 100:
            raise ConfigError(f"{what}: {budget!r} is above 100%")
        return int(total_bytes * number / 100)
    if unit not in _UNITS:
        raise ConfigError(
            f"{what}: unknown unit {match.group(2)!r} in {budget!r}; "
            f"use B, KB, MB, GB, KiB, MiB, GiB"
        )
    return int(number * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary units ("1.50 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class OffloadConfig:
    """Where routed experts live: device slots, host RAM and the disk behind them."""

    expert_budget: Budget = None  # device slots; None = every routed expert resident
    host_budget: Budget = None  # host RAM tier; None = all routed experts (CUDA) / 0 (CPU)
    # Expert-slot policy (offload/policy.py). lfru, least-stale and layer-lru beat lru on
    # replayed hit rates, but the ship gates said NO-SHIP (bench/results/*-gate-policy-*.md:
    # lfru and layer-lru on the CPU, least-stale on the CPU at batch 1 and on the H200).
    policy: str = "lru"
    pin_host_memory: bool = True  # only applies when the compute device is CUDA
    # Next-layer prefetch (offload/predict.py registry name); None = off, the default until the
    # ship gate ships a predictor (last-call: NO-SHIP on the H200, 2026-12-03). Only acts when
    # experts are offloaded (never on the all-resident path). `prefetch_ahead`: how many MoE
    # layers ahead to prefetch for.
    prefetch: str | None = None
    prefetch_ahead: int = 1
    # Prefetch copies move in chunks of this many bytes, so an on-demand miss waits behind at
    # most one chunk of prefetch on the copy stream.
    transfer_chunk_bytes: int = 8 << 20
    # CUDA: how many prefetch chunks sit on the copy stream at once. 1 leaves the link idle
    # between two chunks while the pump thread wakes and issues the next (it also waits for
    # the GIL); more keeps it busy, and an on-demand miss waits behind that many chunks.
    transfer_window: int = 1
    io_threads: int = 2  # background threads reading experts from disk (on-demand first)
    # CPU without a host tier: a fetch returns while its misses are still read (on the read
    # threads) and the MoE loop computes the experts already in place first (same sums, same
    # order). False: every miss is read before fetch returns. The CPU ship gate said SHIP at
    # batch 1 and 4 (bench/results/2026-12-03-gate-late-reads-cpu-trace-b{1,4}.md).
    late_reads: bool = True
    # The device-resident expert cache (offload/device_cache.py): residency, LRU and miss fills
    # on the device, so an offloaded decode step is one CUDA graph. Used when one layer's
    # experts fit the slot pool, the host tier holds every expert and the expert kernels take
    # the model's experts (else a start-up error); off until the ship gate measures it.
    device_cache: bool = False
    # Streamed steps (layer streaming, `moe_stream_share`: long prefills, big batches) evict in
    # the step's next-use order (offload/step_aware.py): layers finished in the step first, the
    # one just finished first, then layers ahead, the farthest first. Such a step touches nearly
    # every expert of every layer in layer order, so this is Belady's rule there, where LRU
    # evicts the layers ahead (loaded longest ago) that are needed soonest (48 x 128 experts at
    # 25%: 6,144 -> 4,608-4,864 loads a 2,048-token step in replay, bench/results/2026-12-06-
    # step-aware-eviction.md). Steps that do not stream use `policy` alone, exactly as off.
    stream_eviction: bool = True
    # A streamed step's prefetch of the next layer goes on the copy stream at once, whole,
    # rather than chunk by chunk through the pump thread (ExpertCache.prefetch says why).
    # Both on by default since the H100 ship gates of 2026-12-07 (2,048-token prompts at 25%,
    # Qwen3-30B-A3B and DeepSeek-V2-Lite shapes, 12 layers): together TTFT -20 to -22% against
    # both off, TPOT within 2% (bench/results/2026-12-07-s19-stream-defaults-h100.md).
    stream_copy_now: bool = True

    def __post_init__(self) -> None:
        for name in ("stream_eviction", "stream_copy_now"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _at_least_1("prefetch_ahead", self.prefetch_ahead, "MoE layers ahead to prefetch for")
        _at_least_1("transfer_chunk_bytes", self.transfer_chunk_bytes, "bytes per prefetch copy")
        _at_least_1("transfer_window", self.transfer_window, "prefetch chunks on the copy stream")
        _at_least_1("io_threads", self.io_threads, "disk read threads")
        if self.prefetch is not None and not isinstance(self.prefetch, str):
            raise ConfigError(f"prefetch must be a predictor name or None, got {self.prefetch!r}")


# max_num_seqs when the user gives none (LLM, --max-num-seqs).
DEFAULT_MAX_NUM_SEQS = 64
GPU_MEMORY_HELP = (
    "one device-memory budget for non-expert weights, a reserve, expert slots and KV blocks: "
    "bytes ('24GiB') or a share of the device ('90%%'; on the CPU: of the host's RAM); the "
    "split is logged at start-up (README: One memory budget)"
)
DEVICE_CACHE_HELP = (
    "keep the expert cache's residency, LRU policy and miss fills on the device (misses read "
    "from page-locked host RAM by a kernel, no host sync per layer); needs one layer's experts "
    "to fit the expert budget and the host tier to hold every expert"
)
STREAM_EVICTION_HELP = (
    "streamed steps (long prompts, big batches; layer streaming) evict in the step's next-use "
    "order around --policy: layers finished in the step first, then the farthest ahead "
    "(default: on; --no-stream-eviction: --policy alone)"
)
STREAM_COPY_NOW_HELP = (
    "a streamed step's loads of the next layer go on the CUDA copy stream at once, whole, not "
    "chunk by chunk through the prefetch pump (default: on)"
)
ROUTING_TRACE_HELP = (
    "a moetier-trace file (moetier record-trace): with --gpu-memory and no --max-num-seqs, the "
    "split between expert slots and KV blocks follows its replayed hit-rate curve"
)


@dataclass(frozen=True)
class MemoryConfig:
    """One device-memory budget split between expert slots and KV blocks
    (engine/memory_split.py)."""

    gpu_memory: Budget = None  # None: separate budgets (expert_budget, num_kv_blocks)
    routing_trace: str | None = None  # a moetier-trace file whose hit-rate curve sizes the split
    # True when the user set max_num_seqs: the KV then holds max_num_seqs full-length sequences.
    # False (LLM without max_num_seqs): with a routing trace, the split may hold fewer when the
    # expert slots they would cost are worth more.
    seqs_fixed: bool = True

    def __post_init__(self) -> None:
        if self.routing_trace is not None and self.gpu_memory is None:
            raise ConfigError(
                "routing_trace (--routing-trace) sizes the split of gpu_memory (--gpu-memory); "
                "set gpu_memory too, or leave the trace out"
            )
        if self.gpu_memory is not None:
            parse_budget(self.gpu_memory, 0, "gpu_memory")


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences and tokens one engine step may hold."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 4096

    def __post_init__(self) -> None:
        _at_least_1("max_num_seqs", self.max_num_seqs, "sequences in one step")
        _at_least_1("max_num_batched_tokens", self.max_num_batched_tokens, "tokens in one step")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: tokens per block, how many blocks, and the longest sequence admitted."""

    block_size: int = 16
    num_blocks: int | None = None  # None = what kv_cache_bytes buys
    kv_cache_bytes: Budget = None  # None = 4 GiB on CUDA, 512 MiB on CPU (capped by need)
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    # Automatic prefix caching (engine/block_manager.py): full KV blocks are kept by content
    # after their request ends and a prompt starting with the same tokens reuses them instead
    # of recomputing. Exact (greedy tokens equal with it off); on by default, as in vLLM.
    enable_prefix_caching: bool = True
    # How K/V are stored (engine/kv_cache.py KV_FORMATS): "auto" = the model dtype (exact);
    # "int8" / "fp8" = int8 or float8 e4m3 values with a float32 absmax scale per (token, head),
    # dequantized on read (lossy, about half of bf16's bytes; fp8 on CUDA needs compute
    # capability 8.9+); bf16/fp16/fp32 cast on write and read.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"unknown KV cache dtype {self.kv_cache_dtype!r}; choose one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        _at_least_1("kv_block_size", self.block_size, "tokens per KV block")
        if self.num_blocks is not None:
            _at_least_1("num_kv_blocks", self.num_blocks, "KV blocks (None = sized from memory)")
        if self.max_model_len is not None:
            _at_least_1("max_model_len", self.max_model_len, "tokens (None = the checkpoint's)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism (parallel/): routed experts spread over `expert_parallel_size` ranks,
    one process each, every other weight replicated; rank 0 schedules, samples and serves."""

    expert_parallel_size: int = 1
    # "round-robin" (expert e on rank e % N) or "balanced" (by use in `placement_trace`)
    expert_placement: str = "round-robin"
    placement_trace: str | None = None  # a moetier-trace file, for "balanced"
    # Seconds a rank waits in a collective (start-up included) before the group is given up:
    # a rank that died or hangs fails the requests in flight instead of hanging the server.
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        from moetier.parallel.placement import PLACEMENTS

        _at_least_1("expert_parallel_size", self.expert_parallel_size, "ranks; 1 = one process")
        if self.expert_placement not in PLACEMENTS:
            raise ConfigError(
                f"unknown expert placement {self.expert_placement!r}; choose one of "
                f"{', '.join(PLACEMENTS)}"
            )
        if self.expert_placement == "balanced" and self.placement_trace is None:
            raise ConfigError(
                "expert placement 'balanced' places experts by their use in a routing trace: "
                "pass placement_trace (--placement-trace FILE, from `moetier record-trace`)"
            )
        if self.placement_trace is not None and not Path(self.placement_trace).is_file():
            raise ConfigError(f"placement trace {self.placement_trace}: no such file")
        if not self.timeout_s > 0:
            raise ConfigError(
                f"expert-parallel timeout must be > 0 seconds, got {self.timeout_s!r}"
            )


def _at_least_1(name: str, value: object, what: str) -> None:
    """Refuse a count below 1 (a step of 0 sequences or tokens would never make progress)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1 ({what}), got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start: model, device, dtype and the per-concern parts."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    progress: bool = True
    # MoE fast path: a step with more (token, expert) pairs than the slot kernel takes (prefill,
    # large batches) is computed by the grouped kernel (kernels/grouped_ffn.py), reading the
    # slots in place, waves of it when the step's experts exceed the slot pool. None = on for
    # CUDA when Triton imports; off = the per-expert loop (the CPU default).
    moe_grouped_kernel: bool | None = None
    # The expert kernels on MXFP4 slots (gpt-oss's released experts). On since the GPU suite
    # compiled them (2026-12-06, H200 and H100; gpt-oss-20b on an H100: TPOT 91.1 -> 9.6 ms);
    # off: MXFP4 experts take the per-expert loop, decoded one at a time.
    moe_mxfp4_kernel: bool = True
    # MoE fast path: a step with at most this many (token, expert) pairs is computed by the
    # slot-reading kernel (kernels/expert_ffn.py). None = the measured crossover with the
    # grouped kernel on CUDA with Triton (SLOT_KERNEL_MAX_PAIRS), off on CPU.
    moe_slot_kernel_max_pairs: int | None = None
    # Layer streaming with experts offloaded (layers/moe.py): a MoE layer call touching at least
    # this share of its layer's experts prefetches all of the next MoE layer's. None = 0.9 on
    # CUDA (a prompt of ~40+ tokens or a batch of ~40+ at top-8 of 128), off on the CPU; 0 = off.
    moe_stream_share: float | None = None
    # RMSNorm and rotary as one Triton kernel each (kernels/rmsnorm_rope.py). None = on for CUDA
    # when Triton imports, off on the CPU.
    fused_kernels: bool | None = None
    # Replay decode steps that need no host decision (every expert resident) as CUDA graphs
    # (engine/graphs.py). None = on for CUDA; ignored on the CPU.
    cuda_graphs: bool | None = None
    # Offloaded decode steps as piecewise CUDA graphs: one graph from each MoE layer's routing
    # to the next, the host deciding fetches and slots in between (engine/graphs.py). None =
    # on with cuda_graphs (H200, DeepSeek-V2-Lite shape, 25%: 104 -> 54 ms a token).
    piecewise_graphs: bool | None = None
    # Replay the prefill of a fresh prompt (nothing cached before it, computed whole, one per
    # step) as a CUDA graph per length bucket (engine/prefill_graphs.py), under the decode
    # whole-graph rule (every expert resident, or the device cache). None = on with cuda_graphs.
    prefill_graphs: bool | None = None
    # The largest prefill graph bucket in tokens; the buckets are the powers of two from 16
    # below it, then it. A longer prompt prefills eagerly.
    prefill_graph_max_tokens: int = 512
    # Torch CPU threads (threads.py): None = auto on a CPU device (usable cores less the other
    # work on the machine, at least 1) and torch's own choice on CUDA; an int >= 1 is used as is.
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None:
            _at_least_1("threads", self.threads, "torch CPU threads; None = auto")
        _at_least_1(
            "prefill_graph_max_tokens",
            self.prefill_graph_max_tokens,
            "tokens of the largest CUDA-graph prefill bucket",
        )
