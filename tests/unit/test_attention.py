"""The CPU prefill paths against SDPA with the explicit causal mask they replace: a chunk with
cached history (`_attend_with_history`: the history and the new tokens in two mask-free flash
calls, merged by log-sum-exp) on random inputs (GQA, MQA, MHA) and through `attend` over a paged
KV cache with the switch on and off; fresh prompts (`is_causal`, no mask built) through
`attend`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moetier.engine.block_manager import BlockManager
from moetier.engine.kv_cache import KV_FORMATS, LayerKV, PagedKVCache
from moetier.layers import attention
from moetier.layers.attention import _attend_with_history, attend
from moetier.layers.context import ForwardContext, SeqSpan

CPU = torch.device("cpu")


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """The reference: query j (position past + j) sees keys 0 .. past + j, one masked call."""
    n, keys = q.shape[2], k.shape[2]
    mask = torch.arange(keys)[None, :] <= torch.arange(n)[:, None] + past  # [n, L]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "past", "n"),
    [
        (8, 2, 16, 37, 21),  # GQA, history longer than the chunk
        (9, 3, 64, 1000, 130),  # the demo's heads; history over several flash key blocks
        (4, 4, 32, 5, 64),  # MHA, chunk longer than the history
        (6, 1, 64, 300, 1),  # MQA, one new token
        (4, 2, 16, 1, 7),  # one cached token
    ],
)
@pytest.mark.parametrize("sharpness", [1.0, 8.0])
def test_split_history_matches_the_masked_call(
    heads: int, kv_heads: int, d: int, past: int, n: int, sharpness: float
) -> None:
    """Float32, unit-normal inputs (sharpness 8: peaked softmaxes, where a wrong merge weight
    shows most): the two paths differ by float rounding only, measured <= 2e-7. atol 2e-6 is
    10x that; a wrong merge, causal offset or GQA head order is off by order 0.1-1."""
    g = torch.Generator().manual_seed(past * 1000 + n)
    q = sharpness * torch.randn(1, heads, n, d, generator=g)
    k = torch.randn(1, kv_heads, past + n, d, generator=g)
    v = torch.randn(1, kv_heads, past + n, d, generator=g)
    got = _attend_with_history(q, k, v, past, d**-0.5)
    assert got.shape == (1, heads, n, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, _masked(q, k, v, past), atol=2e-6, rtol=1e-5)


def test_split_history_in_bfloat16_is_as_close_as_the_masked_call() -> None:
    """bfloat16 (merged in float32, then rounded): within bfloat16 rounding of the float32
    reference, as the masked bfloat16 call is."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, t, 32, generator=g) for h, t in ((8, 40), (2, 90), (2, 90)))
    exact = _masked(q, k, v, 50)
    got = _attend_with_history(q.bfloat16(), k.bfloat16(), v.bfloat16(), 50, 32**-0.5)
    masked = _masked(q.bfloat16(), k.bfloat16(), v.bfloat16(), 50)
    assert got.dtype == torch.bfloat16
    err, ref_err = (got.float() - exact).abs().max(), (masked.float() - exact).abs().max()
    assert err <= 2 * ref_err + 1e-3


def _two_steps(split: bool) -> list[torch.Tensor]:
    """Step 1: seq 0 prefills 10 tokens. Step 2: seq 0 prefills 7 more (past 10) beside
    seq 1's fresh 5. GQA: 4 query heads over 2 KV heads, d 16. The outputs of both steps.
    Sets the switch: call under a monkeypatch of `attention.SPLIT_HISTORY`."""
    attention.SPLIT_HISTORY = split
    g = torch.Generator().manual_seed(0)
    m = BlockManager(num_blocks=8, block_size=4)
    cache = PagedKVCache(m, CPU, {0: LayerKV((2, 16), (2, 16))}, KV_FORMATS["fp32"])
    outs = []
    for step in ([(0, 0, 10)], [(0, 10, 7), (1, 0, 5)]):
        spans: list[SeqSpan] = []
        positions: list[int] = []
        start = 0
        for seq, past, n in step:
            m.allocate(seq, past + n)
            spans.append(SeqSpan(seq, start, start + n, past))
            positions.extend(range(past, past + n))
            start += n
        ctx = ForwardContext(spans, torch.tensor(positions), cache, cache.build_batch(step, start))
        q = torch.randn(start, 4, 16, generator=g)
        k, v = torch.randn(start, 2, 16, generator=g), torch.randn(start, 2, 16, generator=g)
        outs.append(attend(ctx, 0, q, k, v, 16**-0.5))
    return outs


def test_attend_splits_only_chunks_with_history(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = attention._attend_with_history

    def counting(*args: Any) -> torch.Tensor:
        calls.append(args[3])  # past
        return real(*args)

    monkeypatch.setattr(attention, "_attend_with_history", counting)
    monkeypatch.setattr(attention, "SPLIT_HISTORY", True)
    split = _two_steps(True)
    assert calls == [10]  # seq 0's second chunk only: fresh prompts are `is_causal`
    masked = _two_steps(False)
    assert calls == [10]
    for a, b in zip(split, masked):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_fresh_prompts_are_causal_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fresh prompts in one step (130 and 7 tokens; the demo's 9 query heads over 3 KV
    heads of 64): `attend` builds no causal mask for them, and each equals the masked call
    bit for bit (the flash kernel's fully masked key blocks add exact zeros; with `is_causal`
    it skips them)."""
    built: list[int] = []
    real = attention._causal_mask

    def counting(ctx: ForwardContext, i: int, *args: Any) -> torch.Tensor:
        built.append(i)
        return real(ctx, i, *args)

    monkeypatch.setattr(attention, "_causal_mask", counting)
    g = torch.Generator().manual_seed(3)
    m = BlockManager(num_blocks=48, block_size=4)
    cache = PagedKVCache(m, CPU, {0: LayerKV((3, 64), (3, 64))}, KV_FORMATS["fp32"])
    step = [(0, 0, 130), (1, 0, 7)]
    spans, start = [], 0
    for seq, past, n in step:
        m.allocate(seq, n)
        spans.append(SeqSpan(seq, start, start + n, past))
        start += n
    positions = torch.cat([torch.arange(n) for _, _, n in step])
    ctx = ForwardContext(spans, positions, cache, cache.build_batch(step, start))
    q = torch.randn(start, 9, 64, generator=g)
    k, v = torch.randn(start, 3, 64, generator=g), torch.randn(start, 3, 64, generator=g)
    out = attend(ctx, 0, q, k, v, 64**-0.5)
    assert built == []
    for span in spans:
        rows = slice(span.start, span.end)
        qs, ks, vs = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        want = _masked(qs, ks, vs, 0)[0].transpose(0, 1)
        assert torch.equal(out[rows], want)
