"""Splits one device-memory budget (`gpu_memory`, `--gpu-memory`) between expert slots and KV
blocks.

Owns the split's arithmetic: the reserve rule, the KV request, explicit overrides, the trace
objective and the "cannot fit" errors. It allocates nothing (offload/builder.py and
engine/kv_cache.py build from the counts it returns) and reads a routing trace only through
bench/replay.py and bench/belady.py (the replay `moetier replay` runs), imported when a trace is
given: the one place the engine reaches into bench/.

The rule (README, "One memory budget"):

    remainder = gpu_memory - non-expert weights (as placed) - reserve
    reserve   = 1 GiB (allocator slack, cuBLAS/Triton workspaces, CUDA-graph pools)
              + max_num_batched_tokens x 16 x hidden_size x dtype bytes (a step's activations)
              + max_num_seqs x vocab_size x 16 (float32 logits and the sampler's copies)

KV request: max_num_seqs full-length sequences, ceil(max_model_len / block_size) blocks each,
in the effective KV format's bytes. Expert slots are decided first (at most every expert, at
least top-k); the KV pool gets every whole block of what is left, so the KV is at least the
request (more blocks only mean more prefix-cache room and fewer preemptions).

- explicit expert_budget and num_kv_blocks: both as given; more than the remainder is an error.
- explicit expert_budget only: its slots; the KV gets the rest (at least one full sequence).
- explicit num_kv_blocks only: those blocks; the experts get the rest (at least top-k).
- neither, max_num_seqs set by the user or no routing trace: the KV request as asked; the
  experts get the rest ("kv_request").
- neither, max_num_seqs not set and a routing trace ("trace"): the KV may hold fewer sequences.
  Candidates hold b = 1, 2, 4, ... and max_num_seqs full sequences; each gives the slots beside
  them, replayed on the trace (the running policy and Belady, bench/replay.py). The chosen
  candidate maximizes decode tokens/s at b running sequences:

      tokens/s  = b / step_s
      step_s    = L x D(b) x expert_bytes x ((1 - h) / LINK_BYTES_PER_S + 1 / HBM_BYTES_PER_S)
      D(b)      = E x (1 - (1 - k / E) ** b)   distinct experts a MoE layer needs in one step

  with L MoE layers of E experts, top-k k, and h the running policy's hit rate replayed on the
  (batch-1) trace at S x k / D(b) slots for a candidate of S slots (S itself when every expert
  is resident): b sequences insert D(b) / k times as many distinct experts a step as one does,
  which stretches an LRU's reuse distances as much. An approximation, stated: it assumes the b
  sequences route independently and the server keeps b running. Ties go to more sequences.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetier.config import EngineConfig, format_bytes, parse_budget
from moetier.engine.state_cache import state_bytes_per_slot, state_layout
from moetier.errors import BudgetError, ConfigError
from moetier.offload.builder import budget_slots, expert_slot_bytes
from moetier.weights.experts import ExpertLayout

log = logging.getLogger(__name__)

GiB = 1 << 30
RESERVE_FIXED_BYTES = GiB
ACTIVATION_VECTORS = 16  # hidden-sized vectors a token keeps in flight at a step's peak
LOGIT_BYTES = 16  # per (sequence, vocab entry): float32 logits and the sampler's copies
# Shared facts (H200): pinned host->device ~52-55 GB/s; device memory read ~4 TB/s (the floor of
# computing resident experts). Only their ratio ranks the candidates.
LINK_BYTES_PER_S = 53e9
HBM_BYTES_PER_S = 4e12

# slots -> (running policy's hit rate, Belady's) on the routing trace
CurveFn = Callable[[list[int]], dict[int, tuple[float, float]]]


@dataclass(frozen=True)
class SplitRequest:
    """What the split divides and what each side needs; bytes as stored on the device."""

    gpu_memory: int
    weights: int
    reserve: int
    expert_bytes: int  # one slot
    total_experts: int
    top_k: int
    moe_layers: int
    num_experts: int  # per MoE layer
    block_bytes: int  # one KV block
    block_size: int
    kv_bytes_per_token: int
    kv_format: str
    max_model_len: int
    max_num_seqs: int
    seqs_fixed: bool

    @property
    def remainder(self) -> int:
        return self.gpu_memory - self.weights - self.reserve

    @property
    def seq_blocks(self) -> int:
        """KV blocks one max_model_len sequence takes."""
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class CurvePoint:
    """One candidate of the trace objective."""

    seqs: int  # full-length sequences the KV holds, at most max_num_seqs
    slots: int
    kv_blocks: int
    replayed_slots: int  # the pool one sequence's share is replayed at: slots x k / D(seqs)
    hit_rate: float  # the running policy's, replayed at replayed_slots
    belady: float
    tokens_per_s: float


@dataclass(frozen=True)
class MemorySplit:
    """The split as built: gpu_memory 0 when none was given (separate budgets)."""

    gpu_memory: int
    weights: int
    reserve: int
    slots: int
    expert_bytes: int
    kv_blocks: int
    block_bytes: int
    reason: str
    curve: tuple[CurvePoint, ...] = ()

    @property
    def expert_side(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def kv_side(self) -> int:
        return self.kv_blocks * self.block_bytes

    def stats(self) -> dict[str, Any]:
        return {
            "gpu_memory_bytes": self.gpu_memory,
            "split_expert_bytes": self.expert_side,
            "split_kv_bytes": self.kv_side,
            "split_reason": self.reason,
        }


def decode_tokens_per_s(req: SplitRequest, seqs: int, hit_rate: float) -> float:
    """The trace objective (module doc): decode tokens/s at `seqs` running sequences."""
    step_bytes = req.moe_layers * distinct_experts(req, seqs) * req.expert_bytes
    step_s = step_bytes * ((1 - hit_rate) / LINK_BYTES_PER_S + 1 / HBM_BYTES_PER_S)
    return seqs / step_s


def choose_split(
    req: SplitRequest,
    slots: int | None = None,
    kv_blocks: int | None = None,
    curve: CurveFn | None = None,
) -> tuple[int, int, str, tuple[CurvePoint, ...]]:
    """(slots, KV blocks, reason, candidates considered) per the module doc's rule; `slots` and
    `kv_blocks`: the explicit settings (None: the split decides)."""
    if req.remainder < 0:
        raise BudgetError(
            f"gpu_memory {format_bytes(req.gpu_memory)} ({req.gpu_memory} B) is below the "
            f"non-expert weights ({req.weights} B) plus the reserve ({req.reserve} B). To fit, "
            f"{_RESERVE_FIXES[0]}, or raise --gpu-memory (LLM(gpu_memory=...))."
        )
    if slots is not None and kv_blocks is not None:
        need = slots * req.expert_bytes + kv_blocks * req.block_bytes
        if need > req.remainder:
            raise _too_small(
                req, f"{slots} expert slots and {kv_blocks} KV blocks", need, _EXPLICIT_FIXES
            )
        return slots, kv_blocks, "explicit", ()
    if slots is not None:
        blocks = _blocks_beside(req, slots)
        if blocks < req.seq_blocks:
            need = slots * req.expert_bytes + req.seq_blocks * req.block_bytes
            raise _too_small(
                req,
                f"{slots} expert slots and one full-length sequence ({req.seq_blocks} KV blocks)",
                need,
                ["lower --expert-budget", *_kv_fixes(req, 1)],
            )
        return slots, blocks, "expert_budget", ()
    if kv_blocks is not None:
        got = _slots_beside(req, kv_blocks)
        if got < req.top_k:
            need = req.top_k * req.expert_bytes + kv_blocks * req.block_bytes
            raise _too_small(
                req,
                f"top-k = {req.top_k} expert slots and {kv_blocks} KV blocks",
                need,
                ["lower --num-kv-blocks"],
            )
        return got, kv_blocks, "num_kv_blocks", ()
    if curve is None or req.seqs_fixed:
        request = req.max_num_seqs * req.seq_blocks
        got = _slots_beside(req, request)
        if got < req.top_k:
            need = req.top_k * req.expert_bytes + request * req.block_bytes
            raise _too_small(
                req, _kv_request_text(req, req.max_num_seqs), need, _kv_fixes(req, req.max_num_seqs)
            )
        return got, _blocks_beside(req, got), "kv_request", ()
    return _by_trace(req, curve)


def _slots_beside(req: SplitRequest, kv_blocks: int) -> int:
    return min(req.total_experts, (req.remainder - kv_blocks * req.block_bytes) // req.expert_bytes)


def _blocks_beside(req: SplitRequest, slots: int) -> int:
    return (req.remainder - slots * req.expert_bytes) // req.block_bytes


def candidate_seqs(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs."""
    out = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*out, max_num_seqs]


def _by_trace(req: SplitRequest, curve: CurveFn) -> tuple[int, int, str, tuple[CurvePoint, ...]]:
    options: list[tuple[int, int, int]] = []  # (seqs, slots, blocks), distinct splits
    for b in candidate_seqs(req.max_num_seqs):
        slots = _slots_beside(req, b * req.seq_blocks)
        if slots < req.top_k:
            break  # more sequences only leave fewer slots
        blocks = _blocks_beside(req, slots)
        if options and options[-1][1] == slots:
            continue  # the same split as fewer sequences (every expert already resident)
        options.append((min(req.max_num_seqs, blocks // req.seq_blocks), slots, blocks))
    if not options:
        need = req.top_k * req.expert_bytes + req.seq_blocks * req.block_bytes
        raise _too_small(req, _kv_request_text(req, 1), need, _kv_fixes(req, 1))
    shares = [replay_slots(req, seqs, slots) for seqs, slots, _ in options]
    rates = curve(sorted(set(shares), reverse=True))
    points = tuple(
        CurvePoint(
            seqs,
            slots,
            blocks,
            share,
            rates[share][0],
            rates[share][1],
            decode_tokens_per_s(req, seqs, rates[share][0]),
        )
        for (seqs, slots, blocks), share in zip(options, shares)
    )
    best = max(points, key=lambda p: (p.tokens_per_s, p.seqs))
    return best.slots, best.kv_blocks, "trace", points


def distinct_experts(req: SplitRequest, seqs: int) -> float:
    """D(b): distinct experts one MoE layer needs in a step of b sequences routed independently."""
    e, k = req.num_experts, req.top_k
    return e * (1 - (1 - k / e) ** seqs)


def replay_slots(req: SplitRequest, seqs: int, slots: int) -> int:
    """The pool a batch-1 trace is replayed at to stand for `seqs` sequences sharing `slots`:
    every expert resident stays so; otherwise slots x k / D(b) (at least 1), since b streams
    insert D(b) / k times the distinct experts a step that one stream does, which stretches an
    LRU's reuse distances as much (the batch-1 hit rate at b sequences would be optimistic)."""
    if slots >= req.total_experts:
        return slots
    return max(1, int(slots * req.top_k / distinct_experts(req, seqs)))


def _kv_request_text(req: SplitRequest, seqs: int) -> str:
    return (
        f"top-k = {req.top_k} expert slots of {req.expert_bytes} B and KV for {seqs} x "
        f"{req.max_model_len} tokens (max_num_seqs x max_model_len: {seqs * req.seq_blocks} "
        f"blocks of {req.block_size} tokens at {req.kv_bytes_per_token} B/token as "
        f"{req.kv_format})"
    )


def _kv_fixes(req: SplitRequest, seqs: int) -> list[str]:
    """What lowers a KV request of `seqs` full-length sequences."""
    fixes = []
    if seqs > 1:
        fixes.append(f"lower --max-num-seqs (now {seqs})")
    fixes.append(f"lower --max-model-len (now {req.max_model_len})")
    if req.kv_format not in ("int8", "fp8"):
        fixes.append("store the KV cache in int8 (--kv-cache-dtype int8)")
    return fixes


_EXPLICIT_FIXES = ["lower --expert-budget or --num-kv-blocks"]
_RESERVE_FIXES = ["lower --max-num-batched-tokens or --max-num-seqs (they size the reserve)"]


def _too_small(req: SplitRequest, what: str, need: int, fixes: list[str]) -> BudgetError:
    """The split cannot fit: the numbers, and what to lower."""
    fixes = [*fixes, "raise --gpu-memory (LLM(gpu_memory=...))"]
    return BudgetError(
        f"gpu_memory {format_bytes(req.gpu_memory)} ({req.gpu_memory} B) cannot hold {what}: "
        f"after the non-expert weights ({req.weights} B) and the reserve ({req.reserve} B) "
        f"{req.remainder} B are left, {need} B are needed. To fit, {', or '.join(fixes)}."
    )


def activation_reserve(
    max_num_batched_tokens: int, max_num_seqs: int, hidden: int, vocab: int, dtype_bytes: int
) -> int:
    """The reserve for activations and workspaces (module doc)."""
    return (
        RESERVE_FIXED_BYTES
        + max_num_batched_tokens * ACTIVATION_VECTORS * hidden * dtype_bytes
        + max_num_seqs * vocab * LOGIT_BYTES
    )


def placed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's own tensors (the non-expert weights and buffers) as placed."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_total(device: torch.device) -> int:
    """Total memory a share ("90%") of gpu_memory is of: the CUDA device's, or the host's RAM
    (MemTotal) on the CPU; 0 when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def trace_curve(path: str, policy: str, num_experts: int, top_k: int, moe_layers: int) -> CurveFn:
    """Hit rates of `policy` and Belady on a routing trace at given slot counts (bench/replay.py);
    a trace of another MoE shape is an error."""
    from moetier.bench.belady import belady
    from moetier.bench.replay import all_keys, load_trace, simulate
    from moetier.offload.policy import make_policy

    if not Path(path).is_file():
        raise ConfigError(f"routing trace {path}: no such file")
    trace = load_trace(path)
    h = trace.header
    if (h.num_experts, h.top_k, len(h.moe_layers)) != (num_experts, top_k, moe_layers):
        raise ConfigError(
            f"routing trace {path} was recorded on {len(h.moe_layers)} MoE layers x "
            f"{h.num_experts} experts, top-{h.top_k}; this model has {moe_layers} x "
            f"{num_experts}, top-{top_k}. Record one on this model (moetier record-trace)."
        )
    keys = all_keys(h)

    def rates(slot_counts: list[int]) -> dict[int, tuple[float, float]]:
        out: dict[int, tuple[float, float]] = {}
        for s in slot_counts:
            initial = keys if s >= len(keys) else []  # every expert fits: preloaded
            hit = simulate(trace.records, s, make_policy(policy), initial).hit_rate
            out[s] = (hit, belady(trace.records, s, initial=initial).hit_rate)
        return out

    return rates


def _text_attr(hf_config: Any, name: str) -> int:
    value = getattr(hf_config, name, None)
    if value is None:
        value = getattr(getattr(hf_config, "text_config", None), name, None)
    return int(value or 0)


def split_memory(
    config: EngineConfig,
    model: torch.nn.Module,
    layout: ExpertLayout,
    hf_config: Any,
    device: torch.device,
    dtype: torch.dtype,
    top_k: int,
    max_model_len: int,
    kv_bytes_per_token: int,
    kv_format: str,
) -> MemorySplit:
    """The split of config.memory.gpu_memory after the non-expert weights are placed."""
    mem, sched = config.memory, config.scheduler
    total = device_total(device)
    budget = parse_budget(mem.gpu_memory, total, "gpu_memory")
    if total and budget > total:
        raise ConfigError(
            f"gpu_memory {mem.gpu_memory!r} is {format_bytes(budget)}, more than the "
            f"{format_bytes(total)} device {device} has"
        )
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    hidden, vocab = _text_attr(hf_config, "hidden_size"), _text_attr(hf_config, "vocab_size")
    reserve = activation_reserve(
        sched.max_num_batched_tokens, sched.max_num_seqs, hidden, vocab, dtype_bytes
    )
    # Hybrid models: the recurrent-state pools (one slot per sequence) are set aside with it.
    reserve += state_bytes_per_slot(state_layout(model), dtype) * sched.max_num_seqs
    expert_bytes = expert_slot_bytes(layout, dtype)
    n_total = len(layout.layers) * layout.num_experts
    bs = config.cache.block_size
    req = SplitRequest(
        budget,
        placed_bytes(model),
        reserve,
        expert_bytes,
        n_total,
        top_k,
        len(layout.layers),
        layout.num_experts,
        bs * kv_bytes_per_token,
        bs,
        kv_bytes_per_token,
        kv_format,
        max_model_len,
        sched.max_num_seqs,
        mem.seqs_fixed,
    )
    fixed_slots = None
    if config.offload.expert_budget is not None:
        fixed_slots = budget_slots(config.offload.expert_budget, expert_bytes, n_total, top_k)
    curve = None
    if mem.routing_trace is not None:
        policy = config.offload.policy
        curve = trace_curve(mem.routing_trace, policy, layout.num_experts, top_k, req.moe_layers)
    slots, blocks, reason, points = choose_split(req, fixed_slots, config.cache.num_blocks, curve)
    split = MemorySplit(
        budget, req.weights, reserve, slots, expert_bytes, blocks, req.block_bytes, reason, points
    )
    _log_split(split, config.offload.policy)
    return split


def _log_split(split: MemorySplit, policy: str) -> None:
    for p in split.curve:
        log.info(
            "memory split candidate: %d sequences, %d expert slots, %d KV blocks: replayed at "
            "%d slots, hit rate %s %.4f, belady %.4f, objective %.1f tokens/s%s",
            p.seqs,
            p.slots,
            p.kv_blocks,
            p.replayed_slots,
            policy,
            p.hit_rate,
            p.belady,
            p.tokens_per_s,
            " (chosen)" if (p.slots, p.kv_blocks) == (split.slots, split.kv_blocks) else "",
        )
    log.info(
        "memory split (%s): gpu_memory %s = non-expert weights %s + reserve %s + %d expert slots "
        "%s + %d KV blocks %s (+ %s unused)",
        split.reason,
        format_bytes(split.gpu_memory),
        format_bytes(split.weights),
        format_bytes(split.reserve),
        split.slots,
        format_bytes(split.expert_side),
        split.kv_blocks,
        format_bytes(split.kv_side),
        format_bytes(
            split.gpu_memory - split.weights - split.reserve - split.expert_side - split.kv_side
        ),
    )
