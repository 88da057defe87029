"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the token mixer of the hybrid
families' linear-attention layers, over a flattened batch with per-sequence recurrent state.

Per sequence a layer carries two states instead of K/V blocks, both in a fixed pool of state
slots (engine/state_cache.py, addressed through `KVBatch.state_slots`): the causal depthwise
conv's last kernel-1 inputs [C, K-1] and the delta rule's recurrent state [Hv, dk, dv]
(float32, as the reference keeps it). A sequence's states are zeroed by the runner before the
step that computes its first token, so chunked prefill and decode carry them across steps.

The recurrence: the chunked form (`chunk_gated_delta_rule`) for prefill chunks, the token-by-
token form (`recurrent_gated_delta_rule`) for one-token decode rows, both in float32 torch
(the reference's own fallback math). On CUDA the `fla` package's kernels replace them and the
`causal_conv1d` package's kernels the conv, when importable (optional: neither is a dependency).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from moetier.layers.context import ForwardContext

log = logging.getLogger(__name__)

# Legend: T tokens in the step, B sequences (decode rows), C conv channels (2 * Hk * dk + Hv *
# dv), K conv kernel, Hk key heads, Hv value heads, dk / dv head dims, n one span's tokens.


class StateStore(Protocol):
    """What a Gated DeltaNet layer needs from the state pool: its two pools, indexed by slot."""

    def conv(self, layer: int) -> torch.Tensor:
        """[slots, C, K-1] in the model dtype."""
        ...

    def recurrent(self, layer: int) -> torch.Tensor:
        """[slots, Hv, dk, dv] float32."""
        ...


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (as the fla kernels normalize q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """[B, n, H*, d] inputs -> float32 [B, Hv, n, d] (q, k repeated per value-head group,
    L2-normalized, q scaled by dk^-0.5) and g, beta [B, Hv, n]."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:  # grouped value heads: key head i serves value heads i*r .. i*r + r - 1
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v, beta, g)
    )
    q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: q, k [B, n, Hk, dk], v [B, n, Hv, dv], g (log decay, <= 0) and beta
    [B, n, Hv], state [B, Hv, dk, dv] -> (out [B, n, Hv, dv] in v's dtype, new state float32).

    Per token: S = S * exp(g); S += k (beta (v - S^T k))^T; out = S^T q."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v)
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t].unsqueeze(-1)  # [B, Hv, dk, 1]
        mem = (s * kt).sum(dim=-2)  # [B, Hv, dv]
        delta = (v[:, :, t] - mem) * beta[:, :, t].unsqueeze(-1)
        s = s + kt * delta.unsqueeze(-2)
        out[:, :, t] = (s * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over chunks of `chunk` tokens (the WY/UT form: within a chunk the
    delta updates become triangular solves and matmuls, across chunks one state update each).
    Shapes as `recurrent_gated_delta_rule`."""
    dtype = v.dtype
    n = q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    b, h = q.shape[:2]
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, -1, chunk).cumsum(dim=-1)  # cumulative log decay within each chunk
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [B, Hv, N, c, c], unit lower triangular
    intra = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(
        system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    s = state.to(values)
    out = torch.zeros_like(values)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = values[:, :, i] - k_decay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, out.shape[-1])[:, :, :n]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


@functools.cache
def cuda_kernels() -> dict[str, Any]:
    """The optional CUDA kernels found: `chunk` and `recurrent` (fla's gated delta rule) and
    `conv_update` (causal_conv1d's decode step). Missing packages leave the torch forms."""
    found: dict[str, Any] = {}
    try:
        from fla.ops.gated_delta_rule import (  # type: ignore[import-not-found]
            chunk_gated_delta_rule as fla_chunk,
        )
        from fla.ops.gated_delta_rule import (
            fused_recurrent_gated_delta_rule as fla_recurrent,
        )

        found.update(chunk=fla_chunk, recurrent=fla_recurrent)
    except Exception:  # noqa: BLE001 - any import failure means: use the torch form
        pass
    try:
        from causal_conv1d import causal_conv1d_update  # type: ignore[import-not-found]

        found.update(conv_update=causal_conv1d_update)
    except Exception:  # noqa: BLE001
        pass
    log.info("Gated DeltaNet CUDA kernels: %s", ", ".join(sorted(found)) or "none (torch forms)")
    return found


class RMSNormGated(nn.Module):
    """The output norm: RMSNorm(x) * weight in x's dtype, times silu(gate) in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(torch.float32))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. `split_proj`: Qwen3.5's separate in_proj_qkv / z / b / a;
    else Qwen3-Next's fused in_proj_qkvz / in_proj_ba, interleaved per key-head group."""

    def __init__(self, config: Any, layer: int, split_proj: bool) -> None:
        super().__init__()
        self.layer = layer
        d = config.hidden_size
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        self.act = ACT2FN[config.hidden_act]
        self.act_name = config.hidden_act
        self.split_proj = split_proj
        if split_proj:
            self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(d, self.hv, bias=False)
            self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(d, 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = RMSNormGated(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)
        self.chunk_size = 64

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.hv, self.dk, self.dv)

    def project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> qkv [T, C] (q, k, v channels in that order), z [T, Hv, dv], b, a [T, Hv]."""
        t = x.shape[0]
        if self.split_proj:
            z = self.in_proj_z(x).view(t, self.hv, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(t, self.hk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, D] -> [T, D]; reads and advances each sequence's states in its slot."""
        states = ctx.states
        if states is None:
            raise RuntimeError(
                f"Gated DeltaNet layer {self.layer} needs recurrent state slots, but the forward "
                "context has none (the model runner allocates them for hybrid models)"
            )
        meta = ctx.kv_batch
        t = x.shape[0]
        qkv, z, b, a = self.project(x)
        beta = b.sigmoid()
        # In float32: the decay of half-precision A_log could overflow to -inf.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        conv_pool, rec_pool = states.conv(self.layer), states.recurrent(self.layer)
        kernels = self.kernels(x)
        weight = self.conv1d.weight  # [C, 1, K]
        core = x.new_empty(t, self.hv, self.dv)
        if meta.decode_rows is not None:
            rows, slots = meta.decode_rows, meta.decode_state_slots
            assert slots is not None, "decode rows without their state slots"
            mixed = self._conv_decode(qkv[rows], conv_pool, slots, kernels)  # [B, C]
            q, k, v = self._split_heads(mixed.unsqueeze(1))  # [B, 1, H*, d]
            out, state = self._recurrent(
                q, k, v, g[rows].unsqueeze(1), beta[rows].unsqueeze(1), rec_pool[slots], kernels
            )
            rec_pool.index_copy_(0, slots, state.to(rec_pool.dtype))
            if len(meta.decode_spans) == len(ctx.spans):
                core = out[:, 0]
            else:
                core[rows] = out[:, 0]
        for i in meta.span_slots or {}:
            span, slot = ctx.spans[i], meta.state_slots[i]
            lo, hi = span.start, span.end
            window = torch.cat((conv_pool[slot], qkv[lo:hi].t().to(conv_pool.dtype)), dim=-1)
            conv_pool[slot] = window[:, -(self.kernel - 1) :]
            mixed = F.conv1d(window[None].to(weight.dtype), weight, groups=self.conv_dim)
            mixed = self.act(mixed)[0].t().to(x.dtype)  # [n, C]
            q, k, v = self._split_heads(mixed.unsqueeze(0))  # [1, n, H*, d]
            out, state = self._chunk(
                q, k, v, g[lo:hi][None], beta[lo:hi][None], rec_pool[slot][None], kernels
            )
            rec_pool[slot] = state[0].to(rec_pool.dtype)
            core[lo:hi] = out[0]
        h = self.norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(h.view(t, self.value_dim))

    def kernels(self, x: torch.Tensor) -> dict[str, Any]:
        """The optional CUDA kernels for this input (none on the CPU: the torch forms)."""
        return cuda_kernels() if x.is_cuda else {}

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, n, C] -> q, k [B, n, Hk, dk], v [B, n, Hv, dv]."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        bsz, n = mixed.shape[:2]
        return (
            q.reshape(bsz, n, self.hk, self.dk),
            k.reshape(bsz, n, self.hk, self.dk),
            v.reshape(bsz, n, self.hv, self.dv),
        )

    def _conv_decode(
        self,
        x: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
        kernels: dict[str, Any],
    ) -> torch.Tensor:
        """One new input per row x [B, C] through the conv, the rows' states [B, C, K-1]
        shifted by one in the pool -> activated [B, C]."""
        weight = self.conv1d.weight
        update = kernels.get("conv_update")
        if update is not None and self.act_name in ("silu", "swish"):
            state = pool[slots]  # the kernel shifts it in place; written back below
            out = update(x, state, weight.squeeze(1), None, "silu")
            pool.index_copy_(0, slots, state)
            return out  # type: ignore[no-any-return]
        window = torch.cat((pool[slots], x.unsqueeze(-1).to(pool.dtype)), dim=-1)  # [B, C, K]
        pool.index_copy_(0, slots, window[..., 1:])
        out = F.conv1d(window.to(weight.dtype), weight, groups=self.conv_dim)  # [B, C, 1]
        return self.act(out[..., 0]).to(x.dtype)  # type: ignore[no-any-return]

    def _recurrent(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        kernels: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = kernels.get("recurrent")
        if fused is None:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state)
        q, k = self._repeat_groups(q), self._repeat_groups(k)
        out, final = fused(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return out, final

    def _chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        kernels: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = kernels.get("chunk")
        if fused is None:
            return chunk_gated_delta_rule(q, k, v, g, beta, state, self.chunk_size)
        q, k = self._repeat_groups(q), self._repeat_groups(k)
        out, final = fused(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return out, final

    def _repeat_groups(self, x: torch.Tensor) -> torch.Tensor:
        """Key-head tensors [B, n, Hk, dk] -> one per value head (the kernels' plain MHA)."""
        return x if self.hk == self.hv else x.repeat_interleave(self.hv // self.hk, dim=2)
