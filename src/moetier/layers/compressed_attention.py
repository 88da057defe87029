"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed KV entries
(HCA: every `rate` tokens pooled; CSA: overlapping windows picked per query by the indexer),
with per-head sinks, partial interleaved rope and a grouped low-rank output projection.

Owns the projections (named as on disk: wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink,
compressor.*, indexer.*) and how its per-token state maps onto the paged KV cache: each token's
row holds its rotated key (= value) and, for compressed layers, the raw compressor (and indexer)
projections, as one shared head of keys (`kv_keys_shape`). The whole history stays cached; a
step reads a sequence's rows (a sliding layer's last `sliding_window` only), attends to the keys
in the window and rebuilds the compressed entries closed so far (layers/kv_compressor.py), each
seen by the queries it closed before (HCA) and, for CSA, picked by the indexer. The rows are a
function of the token prefix alone, so prefix caching, chunked prefill and preemption are exact;
the cost is a wider row than the sliding keys and entries alone would need, and rebuilding the
entries from the whole history each step.
Mirrors transformers' DeepseekV4Attention (eager, its only implementation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.layers.context import ForwardContext
from moetier.layers.hyper_connection import unweighted_rms
from moetier.layers.kv_compressor import Compressor, Indexer, rope_table, rope_tail
from moetier.layers.norm import Float32RMSNorm
from moetier.layers.rotary import RotaryEmbedding

# Legend: T tokens, H heads, d head dim, rd rope dims, r q LoRA rank, g output groups,
# n a span's queries, L a sequence's cached tokens, K visible keys, W compressed entries.

LAYER_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


class CompressedAttention(nn.Module):
    """One layer's attention of kind `LAYER_KINDS[i]`: sliding only, or with an HCA / CSA
    compressor (CSA with its indexer)."""

    attn_sink: torch.Tensor

    def __init__(self, config: Any, layer: int, kind: str) -> None:
        super().__init__()
        if kind not in LAYER_KINDS:
            raise UnsupportedModelError(f"DeepSeek-V4 layer type {kind!r} not in {LAYER_KINDS}")
        self.layer, self.kind = layer, kind
        d, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.head_dim = int(config.num_attention_heads), int(config.head_dim)
        self.groups, self.window, self.eps = int(config.o_groups), int(config.sliding_window), eps
        rd = int(config.qk_rope_head_dim)
        hd = self.head_dim
        self.wq_a = nn.Linear(d, config.q_lora_rank, bias=False)
        self.q_norm = Float32RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * hd, bias=False)
        self.wkv = nn.Linear(d, hd, bias=False)
        self.norm = Float32RMSNorm(hd, eps)
        self.wo_a = nn.Linear(
            self.heads * hd // self.groups, self.groups * config.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(self.groups * config.o_lora_rank, d, bias=False)
        self.register_buffer("attn_sink", torch.empty(self.heads, dtype=torch.float32))
        # sliding layers rotate with the "main" rope, compressed ones with "compress" (as their
        # compressor and indexer do)
        self.rotary = RotaryEmbedding(config, rd, "main" if kind == LAYER_KINDS[0] else "compress")
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if kind != LAYER_KINDS[0]:
            rate = int(config.compress_rates[kind])
            csa = kind == "compressed_sparse_attention"
            self.compressor = Compressor(config, hd, rate, csa, self.rotary)
            if csa:
                self.indexer = Indexer(config, rate, self.rotary)
        parts = [hd]
        parts += [self.compressor.width] if self.compressor is not None else []
        parts += [self.indexer.compressor.width] if self.indexer is not None else []
        self.row_parts = parts
        # the row's width, as one shared head of keys only (engine/kv_cache.py kv_layout)
        self.kv_keys_shape: tuple[int, int] = (1, sum(parts))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        t, hd = x.shape[0], self.head_dim
        q_residual = self.q_norm(self.wq_a(x))  # [T, r]
        q = unweighted_rms(self.wq_b(q_residual).view(t, self.heads, hd), self.eps)  # [T, H, d]
        cos, sin = rope_table(self.rotary, ctx.positions, x.dtype)  # [T, rd/2]
        q = rope_tail(q, cos[:, None], sin[:, None])
        kv = rope_tail(self.norm(self.wkv(x)), cos, sin)  # [T, d]
        row = [kv]
        if self.compressor is not None:
            row.append(self.compressor.project(x))
        if self.indexer is not None:
            row.append(self.indexer.compressor.project(x))
        ctx.kv.write(
            self.layer, torch.cat(row, dim=-1).unsqueeze(1), None, ctx.kv_batch.slot_mapping
        )
        out = q.new_empty(t, self.heads, hd)
        for i, span in enumerate(ctx.spans):
            s = slice(span.start, span.end)
            # a sliding layer needs its window only; a compressed one every row (its entries)
            first = 0 if self.compressor is not None else max(0, span.past - self.window + 1)
            slots = _history(ctx, i)[first:]
            rows = ctx.kv.read(self.layer, slots, x.dtype)[0][:, 0]  # [L - first, F]
            out[s] = self._attend(q[s], x[s], q_residual[s], cos[s], sin[s], rows, span.past)
        # K = V carried rope into the output: rotate back by the query's position
        out = rope_tail(out, cos[:, None], -sin[:, None])
        grouped = out.reshape(t, self.groups, -1).transpose(0, 1)  # [g, T, H*d/g]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        y = torch.bmm(grouped, w).transpose(0, 1)  # [T, g, o_lora]
        return self.wo_b(y.reshape(t, -1))

    def _attend(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: torch.Tensor,
        past: int,
    ) -> torch.Tensor:
        """One sequence's n queries q [n, H, d] at positions past .. past+n-1 over its cached
        rows (the last rows.shape[0] of its L = past + n tokens; all of them for a compressed
        layer) -> [n, H, d]."""
        n, total, hd = q.shape[0], past + q.shape[0], self.head_dim
        base = total - rows.shape[0]  # the position of rows[0]
        first = max(0, past - self.window + 1)  # the earliest key any of these queries sees
        qpos = torch.arange(past, total, device=q.device)[:, None]  # [n, 1]
        kpos = torch.arange(first, total, device=q.device)[None, :]  # [1, K]
        keys = rows[first - base :, :hd]  # [K, d]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)  # [n, K]
        comp = self.compressor
        windows = total // comp.rate if comp is not None else 0
        if comp is not None and windows > 0:
            parts = rows.split(self.row_parts, dim=-1)
            entries = comp.entries(parts[1], windows)  # [W, d]
            threshold = (qpos + 1) // comp.rate  # [n, 1] entries closed by each query
            visible = torch.arange(windows, device=q.device)[None, :] < threshold  # [n, W]
            if self.indexer is not None:
                visible = visible & self.indexer.select(
                    x, q_residual, cos, sin, parts[2], windows, threshold
                )
            keys = torch.cat([keys, entries], dim=0)
            mask = torch.cat([mask, visible], dim=-1)
        step = max(1, _LOGITS // (self.heads * keys.shape[0]))
        return torch.cat(
            [
                sink_attention(q[a : a + step], keys, mask[a : a + step], self.attn_sink)
                for a in range(0, n, step)
            ]
        )


_LOGITS = 1 << 26  # logits of one query chunk (256 MiB in float32): rows are independent


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [n, H, d] over keys [K, d] (= values, one shared head), bool mask [n, K], float32
    sinks [H] -> [n, H, d]. HF's eager order: logits in q's dtype, masked, the float32 sink
    column appended (promoting the row to float32, as torch.cat does in HF), the row max
    subtracted, softmax, the sink dropped, probabilities cast back for the value product."""
    logits = torch.matmul(q.transpose(0, 1), keys.t()) * q.shape[-1] ** -0.5  # [H, n, K]
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)  # [H, n, 1]
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)  # [n, H, d]


def _history(ctx: ForwardContext, i: int) -> torch.Tensor:
    """The cache slots [L] of span i's sequence, its tokens 0 .. past + n - 1 in order."""
    meta = ctx.kv_batch
    if meta.span_slots is not None and i in meta.span_slots:
        return meta.span_slots[i]
    assert meta.decode_slots is not None, f"span {i} has no history slots"
    row = meta.decode_spans.index(i)
    return meta.decode_slots[row, : ctx.spans[i].past + 1]
